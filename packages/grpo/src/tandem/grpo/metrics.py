"""Step metrics accumulated over micro-batches and reduced over processes in two collectives.

Token-level metrics are carried as sums (mean x tokens) so the reduced value is the exact
token mean of the global batch, independent of how it was split; maxima are reduced with max.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tandem.grpo.aggregation import LossNormalizer


class MetricSums:
    """Named running sums and maxima of 0-d tensors, kept on device until `reduce`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sums: dict[str, torch.Tensor] = {}
        self.maxes: dict[str, torch.Tensor] = {}

    def add(self, name: str, value: torch.Tensor | float) -> None:
        value = torch.as_tensor(value, dtype=torch.float64, device=self.device).detach()
        self.sums[name] = (
            self.sums.get(name, torch.zeros((), dtype=torch.float64, device=self.device)) + value
        )

    def max(self, name: str, value: torch.Tensor | float) -> None:
        value = torch.as_tensor(value, dtype=torch.float64, device=self.device).detach()
        prev = self.maxes.get(name)
        self.maxes[name] = value if prev is None else torch.maximum(prev, value)

    def reduce(
        self,
        sum_fn: Callable[[torch.Tensor], torch.Tensor],
        max_fn: Callable[[torch.Tensor], torch.Tensor],
        sum_names: list[str],
        max_names: list[str],
    ) -> dict[str, float]:
        """Reduce the named sums and maxima (missing names count as 0) to python floats."""
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        sums = torch.stack([self.sums.get(n, zero) for n in sum_names]) if sum_names else None
        maxes = torch.stack([self.maxes.get(n, zero) for n in max_names]) if max_names else None
        out: dict[str, float] = {}
        if sums is not None:
            out.update(zip(sum_names, sum_fn(sums).tolist(), strict=True))
        if maxes is not None:
            out.update(zip(max_names, max_fn(maxes).tolist(), strict=True))
        return out


LOSS_TOKEN_MEANS = (
    "clip_frac",
    "clip_frac_low",
    "clip_frac_high",
    "dual_clip_frac",
    "ratio_mean",
    "kl",
    "entropy",
)
"""Token means `policy_loss` reports (``kl`` and ``entropy`` only when it computes them)."""

TOKEN_MEANS = (
    *LOSS_TOKEN_MEANS,
    "is_weight_mean",
    "is_clipped_frac",
    "mismatch_k3",
    "nonfinite_logprob_frac",
)
"""Every token-mean metric of a step, accumulated over micro-batches as mean x tokens."""
MAXED = ("ratio_max", "is_weight_max", "staleness_max")
SUMMED = (
    "loss",
    "pg_loss",
    "tokens",
    "reward_sum",
    "staleness_sum",
    "is_w_sq",
    "adv_abs_sum",
    *TOKEN_MEANS,
)
"""Every sum a step accumulates (reduced over processes in one collective)."""


def step_metrics(
    raw: dict[str, float],
    normalizer: LossNormalizer,
    groups: float,
    groups_kept: float,
    all_seqs: float,
    applied: tuple[float, bool] | None,
    lr: float,
    episodes: float | None = None,
) -> dict[str, float]:
    """A step's metrics from its reduced sums and maxima: token means over the global batch,
    the importance weights' effective sample size, and the step's own figures.

    ``all_seqs`` counts rows (staleness is per row: an episode's segments may come from
    different policy versions), ``episodes`` the episodes (default: rows), which the reward
    and advantage means and ``sequences`` count once each however many segments they have."""
    n = max(raw["tokens"], 1.0)
    metrics = {"loss": raw["loss"], "pg_loss": raw["pg_loss"]}
    metrics.update({name: raw[name] / n for name in TOKEN_MEANS})
    w_sum = raw["is_weight_mean"]  # a sum of weights until divided below
    metrics["is_ess"] = w_sum**2 / (n * raw["is_w_sq"]) if raw["is_w_sq"] > 0 else 0.0
    metrics.update({name: raw[name] for name in MAXED})
    grad_norm, step_applied = applied if applied is not None else (0.0, False)
    metrics.update(
        grad_norm=grad_norm,
        step_applied=float(step_applied),
        lr=lr,
        tokens=raw["tokens"],
        sequences=normalizer.total_sequences,
        groups=groups,
        groups_kept=groups_kept,
        reward_mean=raw["reward_sum"] / max(all_seqs if episodes is None else episodes, 1.0),
        advantage_abs_mean=raw["adv_abs_sum"] / max(normalizer.total_sequences, 1.0),
        staleness_mean=raw["staleness_sum"] / max(all_seqs, 1.0),
    )
    return metrics
