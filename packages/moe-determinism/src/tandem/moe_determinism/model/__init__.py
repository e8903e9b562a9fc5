"""The reference Qwen3-MoE-like transformer, its KV cache and Hugging Face IO."""

from tandem.moe_determinism.model.cache import KVCache
from tandem.moe_determinism.model.config import MoEConfig
from tandem.moe_determinism.model.hf import load_hf, save_hf
from tandem.moe_determinism.model.transformer import MoEOutput, MoETransformer, token_logprobs

__all__ = [
    "KVCache",
    "MoEConfig",
    "MoEOutput",
    "MoETransformer",
    "load_hf",
    "save_hf",
    "token_logprobs",
]
