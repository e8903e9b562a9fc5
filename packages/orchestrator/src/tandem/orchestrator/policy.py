"""Building, saving and loading the policy model (Hugging Face layout on disk).

A policy starts either fresh (the reference model shaped by ``[model]``) or from the
Hugging Face directory at ``model.path``. Either way it is saved as a Hugging Face model
directory that transformers and vLLM load unchanged: config.json, safetensors (sharded above
`MAX_SHARD_BYTES`), the tokenizer and generation files of the checkpoint it came from, and
``tandem.json`` (which tokenizer it was trained with, and the stage's notes).

A policy whose checkpoint brought its own tokenizer speaks that tokenizer (`chat_format_for`);
its embedding may have more rows than the tokenizer has ids (a padded vocabulary), which
are never sampled nor scored. A policy of the byte tokenizer has exactly its 266 ids.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import torch

from tandem.moe_determinism import MoEConfig, MoETransformer, load_hf, save_hf
from tandem.orchestrator.config import ConfigValueError
from tandem.orchestrator.inference.formats import has_own_tokenizer
from tandem.orchestrator.inference.template_chat import HFTokenizer
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


def _check_vocab(config: MoEConfig, tokenizer: ByteTokenizer | HFTokenizer) -> None:
    # a checkpoint's own tokenizer: the embedding holds every id it has, and the rows past
    # them (a padded vocabulary) are masked out of sampling and scoring
    if isinstance(tokenizer, HFTokenizer):
        if tokenizer.vocab_size > config.vocab_size:
            raise ConfigValueError(
                f"model.path: the tokenizer has {tokenizer.vocab_size} ids but the checkpoint's "
                f"embedding only {config.vocab_size} rows"
            )
        return
    # the byte tokenizer: exactly its ids, every row of the embedding is sampled
    if config.vocab_size == tokenizer.vocab_size:
        return
    if config.path:
        raise ConfigValueError(
            f"model.path: the checkpoint's vocabulary has {config.vocab_size} ids and the "
            f"tokenizer {tokenizer.vocab_size} (the built-in byte tokenizer: the directory has "
            "no tokenizer.json); put the checkpoint's tokenizer.json and chat template there"
        )
    raise ConfigValueError(
        f"model.vocab_size: {config.vocab_size}, but the tokenizer has "
        f"{tokenizer.vocab_size} ids; set model.vocab_size = {tokenizer.vocab_size}"
    )


def build_model(
    config: MoEConfig, tokenizer: ByteTokenizer | HFTokenizer, *, seed: int = 0
) -> MoETransformer:
    """The policy mid-training starts from: the checkpoint at ``config.path`` (fp32), or a
    freshly initialised reference model shaped by ``config`` (weights from ``seed``); its
    vocabulary must hold the tokenizer's."""
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
    own = has_own_tokenizer(model.config.path)
    if model.config.path:
        _copy_companions(Path(model.config.path), path)
    tokenizer = {"tokenizer": "tokenizer.json"} if own else _byte_tokenizer_meta()
    meta = {**tokenizer, **info}
    (path / "tandem.json").write_text(json.dumps(meta, indent=2))
    return path


def load_policy(directory: str | Path) -> MoETransformer:
    """Load a policy saved by `save_policy` (checking it matches this tokenizer), or a
    Hugging Face model directory (``model.path``) that no stage has saved yet."""
    path = Path(directory)
    meta_file = path / "tandem.json"
    if meta_file.is_file():
        meta = json.loads(meta_file.read_text())
        if meta.get("tokenizer") == "tokenizer.json" and not has_own_tokenizer(path):
            raise PolicyError(f"{path} was saved with its own tokenizer, but has no tokenizer.json")
        if meta.get("tokenizer", "bytes") == "bytes" and meta.get("special_tokens") != list(
            SPECIAL_TOKENS
        ):
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


def _byte_tokenizer_meta() -> dict[str, object]:
    """``tandem.json``'s tokenizer fields for a policy of the byte tokenizer."""
    return {"tokenizer": "bytes", "special_tokens": list(SPECIAL_TOKENS)}


def clone_model(model: MoETransformer) -> MoETransformer:
    """An independent copy (the engine's weights must not alias the trainer's)."""
    return copy.deepcopy(model)
