"""`policy_loss`: the clipped GRPO-family surrogate with KL, entropy and IS weights.

Per token, with advantage ``A`` (one per sequence, broadcast over its tokens) and ratio ``s``:

    l_t = w_t * max(-A s, -A clip(s, 1 - eps_low, 1 + eps_high))  [+ kl_coef * KL_t - ent_coef * H_t]

- token level (PPO/GRPO/DAPO): ``s_t = pi(y_t) / pi_old(y_t)``;
- sequence level (GSPO, Zheng et al., 2025): ``s_i = exp(mean_t log(pi(y_t) / pi_old(y_t)))``,
  applied to every token in the GSPO-token form ``s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)]``,
  whose value is ``s_i`` and whose gradient with ``seq-mean-token-mean`` aggregation is exactly
  GSPO's ``s_i * mean_t grad log pi(y_t)``;
- ``w_t`` are importance weights between trainer and rollout engine (`importance_weights`),
  constants for the gradient.

Every ratio goes through `safe_log_ratio` (clamped in log space), so the loss and gradients
are finite for any input, including -inf log-probs and fully masked rows. Documented
behaviour: a token whose log-prob (or log ratio) is non-finite or beyond the clamp contributes
a finite value and zero gradient; a fully masked row contributes nothing; a sequence whose
advantage is 0 (e.g. an all-equal group) contributes only its KL/entropy terms.

Segment chains: ``episode_ids`` / ``seq_tokens`` make the sequence aggregations treat an
episode's segments as one sequence (see `aggregation`). Ratios and importance weights stay
per row: a GSPO sequence ratio (``ratio_level='sequence'``) and the sequence IS modes are
taken over each segment, because an episode's other segments may be in another micro-batch.
"""

from __future__ import annotations

from typing import get_args

import torch

from tandem.grpo.aggregation import LossNormalizer, aggregate
from tandem.grpo.config import GRPOConfig, RatioLevel
from tandem.grpo.errors import GRPOError
from tandem.grpo.kl import kl_estimate
from tandem.grpo.numerics import as_float, check_token_tensors, masked_sum, safe_log_ratio
from tandem.grpo.segments import episode_loss_tokens


def policy_ratio(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    mask: torch.Tensor,
    config: GRPOConfig,
) -> torch.Tensor:
    """Per-token ratio [B, T] (1 outside the mask), token-level or GSPO sequence-level."""
    log_ratio = safe_log_ratio(logprobs, old_logprobs.detach(), mask, config.log_ratio_clamp)
    if config.ratio_level == "token":
        return log_ratio.exp()
    if config.ratio_level == "sequence":
        seq_log = masked_sum(log_ratio, mask, dim=1) / mask.sum(1).clamp(min=1)
        return (seq_log.detach()[:, None] + log_ratio - log_ratio.detach()).exp()
    raise GRPOError(
        f"unknown ratio_level {config.ratio_level!r}; use one of {get_args(RatioLevel)}"
    )


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    config: GRPOConfig,
    ref_logprobs: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    normalizer: LossNormalizer | None = None,
    kl: torch.Tensor | None = None,
    episode_ids: torch.Tensor | None = None,
    seq_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The scalar loss to minimise and detached metrics (token means over ``mask``).

    Args:
        logprobs: [B, T] log-probs of the sampled tokens under the policy being trained.
        old_logprobs: [B, T] log-probs under the policy the ratio is taken against.
        advantages: [B] (one per sequence) or [B, T].
        mask: [B, T] True at the tokens the loss covers (the policy's own tokens).
        ref_logprobs: [B, T] reference-policy log-probs; needed when ``kl_coef > 0`` and
            ``kl_placement == "loss"``, reported as the ``kl`` metric whenever given.
        is_weights: [B, T] importance weights multiplying the policy-gradient term.
        entropy: [B, T] per-token entropy; needed when ``entropy_coef > 0``.
        normalizer: denominators of the global batch when this is one micro-batch of it.
        kl: [B, T] the exact per-token KL to the reference that the forward hook computed;
            needed with ``kl_estimator='forward'`` and ``kl_coef > 0`` (``ref_logprobs`` is
            then not used).
        episode_ids: [B] rows sharing an id are segments of one episode, one sequence in the
            aggregation; used to count ``normalizer`` and ``seq_tokens`` on this batch alone
            when they are not given.
        seq_tokens: [B] the loss tokens of each row's sequence (its whole episode's for a
            segment), the ``seq-mean-token-mean`` denominator; pass the global batch's
            (`episode_loss_tokens`) for a micro-batch that may hold only part of an episode.

    Metrics: ``loss``, ``pg_loss``, ``clip_frac`` (tokens whose clipped branch is active, so
    their gradient is zero), ``clip_frac_low``, ``clip_frac_high``, ``dual_clip_frac``,
    ``ratio_mean``, ``ratio_max``, ``kl``, ``entropy`` (when available), ``tokens``.
    """
    mask = check_token_tensors(
        mask,
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs,
        is_weights=is_weights,
        entropy=entropy,
        kl=kl,
    )
    logprobs, old_logprobs = as_float(logprobs), as_float(old_logprobs)
    if advantages.dim() == 1 and advantages.shape[0] == mask.shape[0]:
        advantages = advantages[:, None]
    elif advantages.shape != mask.shape:
        raise GRPOError(
            f"advantages must be [batch] or [batch, tokens] matching the mask {tuple(mask.shape)}, "
            f"got {tuple(advantages.shape)}"
        )
    adv = as_float(advantages.detach()).expand(mask.shape)
    normalizer = normalizer or LossNormalizer.from_mask(mask, episode_ids)
    if seq_tokens is None and episode_ids is not None:
        seq_tokens = episode_loss_tokens(mask, episode_ids)

    ratio = policy_ratio(logprobs, old_logprobs, mask, config)
    low, high = 1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(low, high)
    pg = torch.maximum(unclipped, clipped)
    clip_low = mask & (adv < 0) & (ratio.detach() < low)
    clip_high = mask & (adv > 0) & (ratio.detach() > high)
    dual = torch.zeros_like(mask)
    if config.dual_clip is not None:
        bound = -adv * config.dual_clip
        dual = mask & (adv < 0) & (pg.detach() > bound)
        pg = torch.where(adv < 0, torch.minimum(pg, bound), pg)
    if is_weights is not None:
        pg = pg * as_float(is_weights.detach())

    per_token = pg
    if config.kl_estimator == "forward":
        if kl is not None:
            kl = torch.where(mask, as_float(kl), torch.zeros_like(pg))
        elif config.kl_coef > 0:
            raise GRPOError(
                "kl_estimator='forward' with kl_coef > 0 needs the per-token KL from the "
                "forward hook (ForwardOutput.kl); return it or use a sampled estimator"
            )
    elif ref_logprobs is not None:
        kl = kl_estimate(
            logprobs, as_float(ref_logprobs), mask, config.kl_estimator, config.log_ratio_clamp
        )
    else:
        kl = None
    if config.kl_coef > 0 and config.kl_placement == "loss":
        if kl is None:
            raise GRPOError(
                "kl_coef > 0 with kl_placement='loss' needs ref_logprobs; pass them or set "
                "kl_coef=0"
            )
        per_token = per_token + config.kl_coef * kl
    if config.entropy_coef > 0:
        if entropy is None:
            raise GRPOError("entropy_coef > 0 needs per-token entropy from the forward pass")
        per_token = per_token - config.entropy_coef * as_float(entropy)

    def agg(values: torch.Tensor) -> torch.Tensor:
        return aggregate(values, mask, config.loss_agg, normalizer, config.max_tokens, seq_tokens)

    loss = agg(per_token)
    n = mask.sum().clamp(min=1).float()
    with torch.no_grad():
        ratio_d = ratio.detach()
        metrics = {
            "loss": loss.detach(),
            "pg_loss": agg(pg.detach()),
            "clip_frac": (clip_low | clip_high).sum() / n,
            "clip_frac_low": clip_low.sum() / n,
            "clip_frac_high": clip_high.sum() / n,
            "dual_clip_frac": dual.sum() / n,
            "ratio_mean": masked_sum(ratio_d, mask) / n,
            "ratio_max": torch.where(mask, ratio_d, torch.zeros_like(ratio_d)).max()
            if mask.numel()
            else n.new_zeros(()),
            "tokens": mask.sum().float(),
        }
        if kl is not None:
            metrics["kl"] = masked_sum(kl.detach(), mask) / n
        if entropy is not None:
            metrics["entropy"] = masked_sum(as_float(entropy.detach()), mask) / n
    return loss, metrics
