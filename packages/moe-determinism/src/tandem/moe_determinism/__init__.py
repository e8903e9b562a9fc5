"""Batch-invariant ops, deterministic MoE routing and router replay.

Rollout engines and trainers must compute the same numbers for RL on Mixture-of-Experts
models: the same log-probs and the same expert choices for every token. This package holds
the ops, routing and replay machinery that make that hold.
"""

from importlib.metadata import version as _version

from tandem.moe_determinism.errors import MoEDeterminismError
from tandem.moe_determinism.metrics import (
    LogprobComparison,
    RoutingAgreement,
    compare_logprobs,
    routing_agreement,
)
from tandem.moe_determinism.mode import batch_invariant, is_batch_invariant
from tandem.moe_determinism.model import (
    KVCache,
    MoEConfig,
    MoEOutput,
    MoETransformer,
    load_hf,
    save_hf,
    token_logprobs,
)
from tandem.moe_determinism.replay import ReplayMode, RouterReplay, RoutingTrace
from tandem.moe_determinism.routing import Routing, combine, deterministic_topk, route

__version__ = _version("tandem-moe-determinism")

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
    "save_hf",
    "token_logprobs",
]
