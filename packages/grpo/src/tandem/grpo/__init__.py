"""GRPO-family policy losses, group advantages, KL estimators and importance correction.

Pure torch: turns a batch of scored rollouts into a policy update (Dr. GRPO by default).
Names are imported on first use, so the configuration (`GRPOConfig`) loads without torch
and the losses without accelerate, which only `GRPOStep` (the ``trainer`` extra) needs.
``GRPOTrainer`` is a deprecated alias of `GRPOStep` for one release.
"""

from __future__ import annotations

import warnings
from importlib import import_module
from importlib.metadata import version as _version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandem.grpo.advantages import failed_groups, group_advantages, nonconstant_groups
    from tandem.grpo.aggregation import LossNormalizer, aggregate
    from tandem.grpo.batch import (
        ForwardFn,
        ForwardOutput,
        RolloutBatch,
        causal_lm_forward,
        next_token_logprobs,
        shard_by_group,
        token_entropy,
    )
    from tandem.grpo.config import GRPOConfig
    from tandem.grpo.errors import GRPOError
    from tandem.grpo.importance import importance_weights
    from tandem.grpo.kl import forward_kl, kl_estimate, kl_penalized_rewards
    from tandem.grpo.loss import policy_loss, policy_ratio
    from tandem.grpo.segments import episode_loss_tokens
    from tandem.grpo.trainer import GRPOStep

__version__ = _version("tandem-grpo")

_HOME = {
    "ForwardFn": "batch",
    "ForwardOutput": "batch",
    "GRPOConfig": "config",
    "GRPOError": "errors",
    "GRPOStep": "trainer",
    "LossNormalizer": "aggregation",
    "RolloutBatch": "batch",
    "aggregate": "aggregation",
    "causal_lm_forward": "batch",
    "episode_loss_tokens": "segments",
    "group_advantages": "advantages",
    "importance_weights": "importance",
    "forward_kl": "kl",
    "kl_estimate": "kl",
    "kl_penalized_rewards": "kl",
    "next_token_logprobs": "batch",
    "nonconstant_groups": "advantages",
    "failed_groups": "advantages",
    "policy_loss": "loss",
    "policy_ratio": "loss",
    "shard_by_group": "batch",
    "token_entropy": "batch",
}
__all__ = [
    "ForwardFn",
    "ForwardOutput",
    "GRPOConfig",
    "GRPOError",
    "GRPOStep",
    "LossNormalizer",
    "RolloutBatch",
    "__version__",
    "aggregate",
    "causal_lm_forward",
    "episode_loss_tokens",
    "failed_groups",
    "forward_kl",
    "group_advantages",
    "importance_weights",
    "kl_estimate",
    "kl_penalized_rewards",
    "next_token_logprobs",
    "nonconstant_groups",
    "policy_loss",
    "policy_ratio",
    "shard_by_group",
    "token_entropy",
]


# old name -> new name, kept for one release
_DEPRECATED = {"GRPOTrainer": "GRPOStep"}


def __getattr__(name: str) -> Any:
    if name in _DEPRECATED:
        trainer = import_module(f"{__name__}.trainer")
        warnings.warn(trainer._deprecated_alias_message(__name__), DeprecationWarning, stacklevel=2)
        return getattr(trainer, _DEPRECATED[name])
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_HOME[name]}"), name)
