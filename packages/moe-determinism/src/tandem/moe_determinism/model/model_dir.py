"""A local Hugging Face model directory: what it must hold, and its config, without torch.

A run names one with ``model.path``; checking it when the config is read means a wrong path
fails at start with the missing piece named, not after minutes of setup. Nothing is ever
downloaded: the path is a directory on this machine.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from tandem.moe_determinism.errors import MoEDeterminismError
from tandem.moe_determinism.model.config import MoEConfig
from tandem.moe_determinism.model.hf_config import from_hf_config

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def missing_parts(path: Path) -> list[str]:
    """What ``path`` lacks to be a model directory (empty when it is one)."""
    if not path.is_dir():
        return ["the directory itself"]
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not ((path / INDEX_FILE).is_file() or any(path.glob("*.safetensors"))):
        missing.append(f"weights ({SINGLE_FILE}, or shards with {INDEX_FILE})")
    return missing


def check_model_dir(directory: str | Path) -> Path:
    """``directory`` as a Path; raises naming what is missing if it is not a model directory."""
    path = Path(directory).expanduser()
    missing = missing_parts(path)
    if missing:
        raise MoEDeterminismError(
            f"{path} is not a Hugging Face model directory: missing {' and '.join(missing)}"
        )
    return path


def config_from_dir(directory: str | Path) -> MoEConfig:
    """The checked `MoEConfig` of a model directory's config.json (``path`` set to it)."""
    path = Path(directory).expanduser()
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise MoEDeterminismError(f"{cfg_file} not found: not a Hugging Face model directory")
    try:
        raw = json.loads(cfg_file.read_text())
    except ValueError as e:
        raise MoEDeterminismError(f"{cfg_file}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise MoEDeterminismError(f"{cfg_file}: not a JSON object")
    cfg = from_hf_config(raw, str(cfg_file))
    cfg.path = str(path)
    return cfg


_NOT_IN_HF_CONFIG = ("path", "kv_split_size")


def with_checkpoint_shapes(
    config: MoEConfig, *defaults: MoEConfig, name: str = "model"
) -> MoEConfig:
    """``config`` with the shapes of the checkpoint at ``config.path`` (a checked model
    directory). A field of ``config`` that differs from every default (``MoEConfig()`` and
    ``defaults``) was set on purpose and must agree with the checkpoint: two values for one
    setting would leave one silently ignored. Errors name the field as ``{name}.field``."""
    try:
        found = config_from_dir(check_model_dir(config.path))
    except MoEDeterminismError as e:
        raise MoEDeterminismError(f"{name}.path: {e}") from None
    unset = (MoEConfig(), *defaults)
    for field in config.__struct_fields__:
        mine, theirs = getattr(config, field), getattr(found, field)
        if field in _NOT_IN_HF_CONFIG or mine == theirs:
            continue
        if all(mine != getattr(d, field) for d in unset):
            raise MoEDeterminismError(
                f"{name}.{field}: {mine!r}, but the checkpoint at {name}.path has {theirs!r}; "
                f"with {name}.path, leave the shapes to its config.json"
            )
    return msgspec.structs.replace(found, kv_split_size=config.kv_split_size)
