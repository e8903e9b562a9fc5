"""Importance correction between the trainer's and the rollout engine's log-probs.

Async RL samples from an inference engine whose numerics (kernels, batch composition, fp8)
and weights (a few steps stale) differ from the trainer's. The policy gradient is then
off-policy by ``rho_t = pi_trainer(y_t) / pi_rollout(y_t)``; these weights multiply the
policy-gradient term of each token (they carry no gradient themselves).

Modes (``cap`` is the upper bound C, ``lower`` the lower bound of the masked modes):

- ``none``: weight 1.
- ``token_tis``: truncated IS, ``min(rho_t, C)`` (Yao et al., 2025; C = 2 in verl and TRL).
- ``token_mis``: masked IS, ``rho_t`` if ``lower <= rho_t <= C`` else 0: out-of-band tokens
  are dropped instead of being kept at the cap.
- ``sequence_mis``: ``rho(y) = prod_t rho_t``; every token of the sequence gets ``rho(y)`` if
  it is in band, else 0 (Liu et al., "When speed kills stability", 2025).
- ``geometric_mis``: the geometric mean ``exp(mean_t log rho_t)`` decides acceptance of the
  whole sequence; accepted sequences get weight 1, rejected ones 0 (rejection sampling with a
  length-normalised test, the first choice recommended by SkyRL). Use a tight band (C ~ 1.01).

All ratios are formed in log space and clamped (see `numerics`), so +-80 gaps and -inf
log-probs give finite weights: a trainer log-prob of -inf gives rho ~ 0, a rollout log-prob
of -inf gives rho at the clamp (then truncated or masked), both -inf give rho = 1.
"""

from __future__ import annotations

from typing import get_args

import torch

from tandem.grpo.config import ISMode
from tandem.grpo.errors import GRPOError
from tandem.grpo.numerics import as_float, check_token_tensors, masked_sum, safe_log_ratio

IS_MODES: tuple[str, ...] = get_args(ISMode)


def default_lower(mode: ISMode, cap: float) -> float:
    """The lower bound used when none is given: 1/cap for the geometric test, else 0."""
    return 1.0 / cap if mode == "geometric_mis" else 0.0


@torch.no_grad()
def importance_weights(
    trainer_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    mode: ISMode = "token_tis",
    cap: float = 2.0,
    lower: float | None = None,
    clamp: float = 20.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token weights [B, T] (float32, 0 outside ``mask``) and their statistics.

    Metrics (over loss tokens): ``is_weight_mean``, ``is_weight_max``, ``is_clipped_frac``
    (fraction of tokens truncated or masked), ``is_ess`` (normalised effective sample size
    ``(sum w)^2 / (n sum w^2)`` in [0, 1]; 1 when every weight is equal), ``is_tokens``.
    """
    if mode not in IS_MODES:
        raise GRPOError(f"unknown importance-sampling mode {mode!r}; use one of {IS_MODES}")
    if not cap > 0:
        raise GRPOError(f"cap must be > 0, got {cap}")
    mask = check_token_tensors(
        mask, trainer_logprobs=trainer_logprobs, rollout_logprobs=rollout_logprobs
    )
    lo = default_lower(mode, cap) if lower is None else lower
    log_rho = safe_log_ratio(as_float(trainer_logprobs), as_float(rollout_logprobs), mask, clamp)
    ones = torch.ones_like(log_rho)
    if mode == "none":
        weights, clipped = ones, torch.zeros_like(mask)
    elif mode == "token_tis":
        rho = log_rho.exp()
        weights, clipped = rho.clamp(max=cap), rho > cap
    elif mode == "token_mis":
        rho = log_rho.exp()
        keep = (rho >= lo) & (rho <= cap)
        weights, clipped = torch.where(keep, rho, torch.zeros_like(rho)), ~keep
    else:
        seq_log = masked_sum(log_rho, mask, dim=1)
        if mode == "geometric_mis":
            seq_log = seq_log / mask.sum(1).clamp(min=1)
        seq_rho = seq_log.clamp(-clamp, clamp).exp()
        keep = (seq_rho >= lo) & (seq_rho <= cap)
        value = seq_rho if mode == "sequence_mis" else torch.ones_like(seq_rho)
        seq_w = torch.where(keep, value, torch.zeros_like(value))
        weights = seq_w[:, None].expand_as(log_rho)
        clipped = (~keep)[:, None].expand_as(mask)
    weights = torch.where(mask, weights, torch.zeros_like(weights))
    return weights, importance_metrics(weights, clipped & mask, mask)


def importance_metrics(
    weights: torch.Tensor, clipped: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Statistics of IS weights over the loss tokens (all finite, 0 for an empty mask)."""
    n = mask.sum().float()
    total = masked_sum(weights, mask)
    square = masked_sum(weights.square(), mask)
    masked_w = torch.where(mask, weights, torch.zeros_like(weights))
    return {
        "is_weight_mean": total / n.clamp(min=1),
        "is_weight_max": masked_w.max() if masked_w.numel() else total.new_zeros(()),
        "is_clipped_frac": clipped.sum().float() / n.clamp(min=1),
        "is_ess": torch.where(square > 0, total.square() / (n * square).clamp(min=1e-30), 0.0),
        "is_tokens": n,
    }
