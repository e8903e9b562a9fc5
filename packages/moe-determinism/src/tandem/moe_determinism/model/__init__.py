"""The reference Qwen3-MoE / Qwen3 transformer, its KV cache and Hugging Face IO.

Names are imported on first use, so `tandem.moe_determinism.model.config` (plain data)
loads without torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandem.moe_determinism.model.cache import KVCache
    from tandem.moe_determinism.model.config import MoEConfig
    from tandem.moe_determinism.model.hf import load_hf, read_config, save_hf
    from tandem.moe_determinism.model.transformer import MoEOutput, MoETransformer

_HOME = {
    "KVCache": "cache",
    "MoEConfig": "config",
    "MoEOutput": "transformer",
    "MoETransformer": "transformer",
    "load_hf": "hf",
    "read_config": "hf",
    "save_hf": "hf",
}
__all__ = [
    "KVCache",
    "MoEConfig",
    "MoEOutput",
    "MoETransformer",
    "load_hf",
    "read_config",
    "save_hf",
]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_HOME[name]}"), name)
