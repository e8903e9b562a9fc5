"""Building, saving and loading the policy model (HF Qwen3-MoE layout on disk)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from tandem.moe_determinism import MoEConfig, MoETransformer, load_hf, save_hf
from tandem.orchestrator.config import ModelConfig
from tandem.orchestrator.tokenizer import SPECIAL_TOKENS, ByteTokenizer


class PolicyError(RuntimeError):
    """A policy directory is missing or was made for another tokenizer."""


def build_model(config: ModelConfig, tokenizer: ByteTokenizer) -> MoETransformer:
    """A freshly initialised reference MoE sized by ``config`` for ``tokenizer``."""
    moe = MoEConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        moe_intermediate_size=config.moe_intermediate_size,
        num_experts=config.num_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        max_position_embeddings=config.max_position_embeddings,
        kv_split_size=config.kv_split_size,
    )
    model = MoETransformer(moe)
    model.reset_parameters(seed=config.init_seed)
    return model


def save_policy(model: MoETransformer, directory: str | Path, **info: object) -> Path:
    """HF layout (config.json + model.safetensors) plus the tokenizer's special tokens."""
    path = save_hf(model, directory)
    meta = {"tokenizer": "bytes", "special_tokens": list(SPECIAL_TOKENS), **info}
    (path / "tandem.json").write_text(json.dumps(meta, indent=2))
    return path


def load_policy(directory: str | Path) -> MoETransformer:
    """Load a policy saved by `save_policy`, checking it matches this tokenizer."""
    path = Path(directory)
    meta_file = path / "tandem.json"
    if not meta_file.is_file():
        raise PolicyError(
            f"{path} is not a tandem policy directory (no tandem.json); run `tandem midtrain` "
            "first or point to its output"
        )
    meta = json.loads(meta_file.read_text())
    if meta.get("special_tokens") != list(SPECIAL_TOKENS):
        raise PolicyError(
            f"{path} was saved with other special tokens: {meta.get('special_tokens')}"
        )
    return load_hf(path, dtype=torch.float32)


def clone_model(model: MoETransformer) -> MoETransformer:
    """An independent copy (the engine's weights must not alias the trainer's)."""
    return copy.deepcopy(model)
