"""Building, saving and loading the policy model (HF Qwen3-MoE layout on disk)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from tandem.moe_determinism import MoEConfig, MoETransformer, load_hf, save_hf
from tandem.orchestrator.config import ConfigValueError
from tandem.orchestrator.inference.tokenizer import SPECIAL_TOKENS, ByteTokenizer


class PolicyError(RuntimeError):
    """A policy directory is missing or was made for another tokenizer."""


def build_model(config: MoEConfig, tokenizer: ByteTokenizer, *, seed: int = 0) -> MoETransformer:
    """A freshly initialised reference MoE shaped by ``config`` (weights from ``seed``); its
    vocabulary must be the tokenizer's."""
    if config.vocab_size != tokenizer.vocab_size:
        raise ConfigValueError(
            f"model.vocab_size: {config.vocab_size}, but the tokenizer has "
            f"{tokenizer.vocab_size} ids; set model.vocab_size = {tokenizer.vocab_size}"
        )
    model = MoETransformer(config)
    model.reset_parameters(seed=seed)
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
