"""Batch-invariant ops, deterministic MoE routing and router replay.

Rollout engines and trainers must compute the same numbers for RL on Mixture-of-Experts
models: the same log-probs and the same expert choices for every token. This package holds
the ops, routing and replay machinery that make that hold.

Names are imported on first use, so its configuration (`MoEConfig`) loads without torch.
"""

from __future__ import annotations

from importlib import import_module
from importlib.metadata import version as _version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandem.moe_determinism.errors import MoEDeterminismError
    from tandem.moe_determinism.logprobs import (
        sampling_logits,
        target_logprobs,
        target_logprobs_entropy,
    )
    from tandem.moe_determinism.metrics import (
        LogprobComparison,
        RoutingAgreement,
        compare_logprobs,
        routing_agreement,
    )
    from tandem.moe_determinism.mode import batch_invariant, is_batch_invariant, stock_kernels
    from tandem.moe_determinism.model import (
        KVCache,
        MoEConfig,
        MoEOutput,
        MoETransformer,
        load_hf,
        save_hf,
    )
    from tandem.moe_determinism.replay import ReplayMode, RouterReplay, RoutingTrace
    from tandem.moe_determinism.routing import Routing, combine, deterministic_topk, route

__version__ = _version("tandem-moe-determinism")

_HOME = {
    "KVCache": "model",
    "LogprobComparison": "metrics",
    "MoEConfig": "model",
    "MoEDeterminismError": "errors",
    "MoEOutput": "model",
    "MoETransformer": "model",
    "ReplayMode": "replay",
    "RouterReplay": "replay",
    "Routing": "routing",
    "RoutingAgreement": "metrics",
    "RoutingTrace": "replay",
    "batch_invariant": "mode",
    "combine": "routing",
    "compare_logprobs": "metrics",
    "deterministic_topk": "routing",
    "is_batch_invariant": "mode",
    "stock_kernels": "mode",
    "load_hf": "model",
    "route": "routing",
    "routing_agreement": "metrics",
    "sampling_logits": "logprobs",
    "save_hf": "model",
    "target_logprobs": "logprobs",
    "target_logprobs_entropy": "logprobs",
}
__all__ = [
    "KVCache",
    "LogprobComparison",
    "MoEConfig",
    "MoEDeterminismError",
    "MoEOutput",
    "MoETransformer",
    "ReplayMode",
    "RouterReplay",
    "Routing",
    "RoutingAgreement",
    "RoutingTrace",
    "__version__",
    "batch_invariant",
    "combine",
    "compare_logprobs",
    "deterministic_topk",
    "is_batch_invariant",
    "load_hf",
    "route",
    "routing_agreement",
    "sampling_logits",
    "save_hf",
    "stock_kernels",
    "target_logprobs",
    "target_logprobs_entropy",
]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_HOME[name]}"), name)
