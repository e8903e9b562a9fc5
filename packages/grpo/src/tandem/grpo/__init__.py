"""GRPO-family policy losses, group advantages, KL estimators and importance correction.

Pure torch: turns a batch of scored rollouts into a policy update (Dr. GRPO by default).
"""

from importlib.metadata import version as _version

from tandem.grpo.advantages import group_advantages, nonconstant_groups
from tandem.grpo.aggregation import LossNormalizer, aggregate
from tandem.grpo.batch import (
    ForwardFn,
    ForwardOutput,
    RolloutBatch,
    causal_lm_forward,
    shard_by_group,
    token_entropy,
    token_logprobs,
)
from tandem.grpo.config import GRPOConfig
from tandem.grpo.errors import GRPOError
from tandem.grpo.importance import importance_weights
from tandem.grpo.kl import kl_estimate, kl_penalized_rewards
from tandem.grpo.loss import policy_loss, policy_ratio
from tandem.grpo.trainer import GRPOTrainer

__version__ = _version("tandem-grpo")

__all__ = [
    "ForwardFn",
    "ForwardOutput",
    "GRPOConfig",
    "GRPOError",
    "GRPOTrainer",
    "LossNormalizer",
    "RolloutBatch",
    "__version__",
    "aggregate",
    "causal_lm_forward",
    "group_advantages",
    "importance_weights",
    "kl_estimate",
    "kl_penalized_rewards",
    "nonconstant_groups",
    "policy_loss",
    "policy_ratio",
    "shard_by_group",
    "token_entropy",
    "token_logprobs",
]
