"""Building, saving and loading the policy model (Hugging Face layout on disk).

A policy starts either fresh (the reference model shaped by ``[model]``) or from the
Hugging Face directory at ``model.path``. Either way it is saved as a Hugging Face model
directory that transformers and vLLM load unchanged: config.json, safetensors (sharded above
`MAX_SHARD_BYTES`), the tokenizer and generation files of the checkpoint it came from, and
``tandem.json`` (which tokenizer it was trained with, and the stage's notes).
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import torch

from tandem.moe_determinism import MoEConfig, MoETransformer, load_hf, save_hf
from tandem.orchestrator.config import ConfigValueError
from tandem.orchestrator.inference.tokenizer import SPECIAL_TOKENS, ByteTokenizer

MAX_SHARD_BYTES = 5 * 2**30
"""Shard size of saved policies (transformers' own default)."""
COMPANION_FILES = (
    "tokenizer*",
    "vocab*",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "generation_config.json",
    "chat_template*",
)
"""Files of a checkpoint directory that travel with its weights (tokenizer, chat template,
generation defaults)."""


class PolicyError(RuntimeError):
    """A policy directory is missing or was made for another tokenizer."""


def _check_vocab(config: MoEConfig, tokenizer: ByteTokenizer) -> None:
    # exactly the tokenizer's ids: the engine samples from every row of the embedding, and
    # an id past the tokenizer's (a checkpoint's padded vocabulary) could not be decoded
    if config.vocab_size == tokenizer.vocab_size:
        return
    if config.path:
        raise ConfigValueError(
            f"model.path: the checkpoint's vocabulary has {config.vocab_size} ids and the "
            f"tokenizer {tokenizer.vocab_size}; the engine samples every id of the vocabulary, "
            "so they must be equal"
        )
    raise ConfigValueError(
        f"model.vocab_size: {config.vocab_size}, but the tokenizer has "
        f"{tokenizer.vocab_size} ids; set model.vocab_size = {tokenizer.vocab_size}"
    )


def build_model(config: MoEConfig, tokenizer: ByteTokenizer, *, seed: int = 0) -> MoETransformer:
    """The policy mid-training starts from: the checkpoint at ``config.path`` (fp32), or a
    freshly initialised reference model shaped by ``config`` (weights from ``seed``); its
    vocabulary must be the tokenizer's."""
    _check_vocab(config, tokenizer)
    if config.path:
        model = load_hf(config.path, dtype=torch.float32, config=config)
        return model
    model = MoETransformer(config)
    model.reset_parameters(seed=seed)
    return model


def _copy_companions(source: Path, target: Path) -> None:
    if source.resolve() == target.resolve():
        return
    for pattern in COMPANION_FILES:
        for f in source.glob(pattern):
            if f.is_file():
                shutil.copy2(f, target / f.name)


def save_policy(model: MoETransformer, directory: str | Path, **info: object) -> Path:
    """HF layout (config.json + safetensors) plus the tokenizer files of the checkpoint the
    model came from (``model.config.path``) and ``tandem.json``."""
    path = save_hf(model, directory, max_shard_bytes=MAX_SHARD_BYTES)
    if model.config.path:
        _copy_companions(Path(model.config.path), path)
    meta = {"tokenizer": "bytes", "special_tokens": list(SPECIAL_TOKENS), **info}
    (path / "tandem.json").write_text(json.dumps(meta, indent=2))
    return path


def load_policy(directory: str | Path) -> MoETransformer:
    """Load a policy saved by `save_policy` (checking it matches this tokenizer), or a
    Hugging Face model directory (``model.path``) that no stage has saved yet."""
    path = Path(directory)
    meta_file = path / "tandem.json"
    if meta_file.is_file():
        meta = json.loads(meta_file.read_text())
        if meta.get("special_tokens") != list(SPECIAL_TOKENS):
            raise PolicyError(
                f"{path} was saved with other special tokens: {meta.get('special_tokens')}"
            )
    elif not (path / "config.json").is_file():
        raise PolicyError(
            f"{path} is not a tandem policy directory (no tandem.json); run `tandem midtrain` "
            "first or point to its output"
        )
    model = load_hf(path, dtype=torch.float32)
    model.config.path = str(path)  # where its tokenizer files are, for the next save
    return model


def clone_model(model: MoETransformer) -> MoETransformer:
    """An independent copy (the engine's weights must not alias the trainer's)."""
    return copy.deepcopy(model)
