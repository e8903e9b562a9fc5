"""Schulman's k1/k2/k3 estimators of KL(pi || pi_ref) from samples of pi.

With ``log r = log pi_ref(x) - log pi(x)`` for a token x sampled from pi (Schulman, "Approximating
KL divergence", 2020):

- k1 = ``-log r``: unbiased, high variance, can be negative per token;
- k2 = ``(log r)^2 / 2``: biased, low variance, always >= 0;
- k3 = ``(r - 1) - log r``: unbiased, always >= 0; its variance grows quickly once the policies
  drift apart, which is why Composer 2 used k1.

The log ratio goes through `safe_log_ratio`, so masked, -inf and +-80 gaps stay finite;
positions outside the mask return 0.
"""

from __future__ import annotations

from typing import get_args

import torch

from tandem.grpo.config import KLEstimator
from tandem.grpo.errors import GRPOError
from tandem.grpo.numerics import as_float, check_token_tensors, masked_sum, safe_log_ratio


def kl_estimate(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    estimator: KLEstimator = "k1",
    clamp: float = 20.0,
) -> torch.Tensor:
    """Per-token KL estimate [B, T] (0 outside ``mask``); differentiable w.r.t. ``logprobs``."""
    mask = check_token_tensors(mask, logprobs=logprobs, ref_logprobs=ref_logprobs)
    log_r = safe_log_ratio(ref_logprobs, logprobs, mask, clamp)
    if estimator == "k1":
        kl = -log_r
    elif estimator == "k2":
        kl = 0.5 * log_r.square()
    elif estimator == "k3":
        kl = torch.expm1(log_r) - log_r
    else:
        raise GRPOError(f"unknown KL estimator {estimator!r}; use one of {get_args(KLEstimator)}")
    return torch.where(mask, kl, torch.zeros_like(kl))


def forward_kl(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """Exact KL(pi_ref || pi) of each position's next-token distribution, over the whole
    vocabulary: ``sum_v pi_ref(v) (log pi_ref(v) - log pi(v))`` for logits [..., V] of the
    policy (with gradient) and of the reference (taken as constants). Shape [...].

    Its gradient with respect to the policy's logits is ``pi - pi_ref``: every token the
    reference gives probability and the policy has dropped is pushed back, sampled or not."""
    logp = torch.log_softmax(as_float(logits), dim=-1)
    ref_logp = torch.log_softmax(as_float(ref_logits.detach()), dim=-1)
    return (ref_logp.exp() * (ref_logp - logp)).sum(-1)


def kl_penalized_rewards(
    rewards: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    estimator: KLEstimator = "k1",
    clamp: float = 20.0,
) -> torch.Tensor:
    """KL in the reward: ``r_i - coef * sum_t kl_t`` over each trajectory's loss tokens.

    ``logprobs`` are the sampling policy's (the rollout's); the penalty carries no gradient.
    """
    kl = trajectory_kl(logprobs, ref_logprobs, mask, estimator, clamp)
    with torch.no_grad():
        return as_float(rewards) - coef * kl


def trajectory_kl(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    estimator: KLEstimator = "k1",
    clamp: float = 20.0,
) -> torch.Tensor:
    """``sum_t kl_t`` [B] over each row's loss tokens, without gradient: the penalty
    `kl_penalized_rewards` charges (summed over an episode's segments when rows are those)."""
    with torch.no_grad():
        kl = kl_estimate(as_float(logprobs), as_float(ref_logprobs), mask, estimator, clamp)
        return masked_sum(kl, mask.bool(), dim=1)
