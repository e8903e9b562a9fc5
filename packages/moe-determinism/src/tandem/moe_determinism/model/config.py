"""Configuration of the reference MoE transformer (Qwen3-MoE field names)."""

from __future__ import annotations

import msgspec

from tandem.moe_determinism.errors import MoEDeterminismError


class MoEConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Shapes of a Qwen3-MoE-like model. Field names follow the Hugging Face config."""

    vocab_size: int = 4096
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 32
    moe_intermediate_size: int = 256
    num_experts: int = 8
    num_experts_per_tok: int = 2
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    """0 = no shared expert (Qwen3-MoE); >0 adds an always-on SwiGLU expert (Kimi/DeepSeek)."""
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    kv_split_size: int = 64
    """Keys per split in batch-invariant attention (fixed size, never a fixed count)."""

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise MoEDeterminismError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise MoEDeterminismError(
                f"num_experts_per_tok must be in [1, num_experts={self.num_experts}]"
            )
        if self.head_dim % 2:
            raise MoEDeterminismError(f"head_dim must be even for RoPE, got {self.head_dim}")
