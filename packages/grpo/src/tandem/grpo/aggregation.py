"""Loss aggregation: how per-token losses become one scalar.

The choice decides how much each token's gradient weighs and is where GRPO variants differ:

- ``token-mean``: ``sum_{i,t} l / N_tokens`` (DAPO): every token weighs the same.
- ``seq-mean-token-mean``: ``mean_i (sum_t l / |y_i|)`` (original GRPO): tokens of short
  answers weigh more, which biases towards short correct and long wrong answers.
- ``seq-mean-token-sum``: ``mean_i sum_t l``.
- ``constant``: ``mean_i (sum_t l / max_tokens)`` (Dr. GRPO): no length normalisation at all.

Sequence means run over the sequences that have at least one loss token, except ``constant``,
which divides by every sequence (a constant per trajectory is its whole point).

The denominators come from a `LossNormalizer` that may describe a larger batch than the one
passed in: summing the losses of micro-batches (and of processes) that all use the normaliser
of the *global* batch gives exactly the loss of the global batch, so the update does not
depend on how the batch was split.

Segment chains (rows sharing an episode id, see `tandem.grpo.segments`): ``token-mean`` is
unchanged, every sampled token weighs the same. The sequence modes take the *episode* as the
sequence: its segments' token losses are summed as if they were one row, the counts are of
episodes, and ``seq-mean-token-mean`` divides by the episode's loss tokens (``seq_tokens``, a
per-row count of the whole batch, sliced with the rows). Each term stays a sum over rows, so
segments of one episode may fall in different micro-batches and the parts still add up to the
global loss; splitting an episode does not change its weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

import torch

from tandem.grpo.config import LossAggregation
from tandem.grpo.errors import GRPOError
from tandem.grpo.numerics import masked_sum
from tandem.grpo.segments import episode_counts

LOSS_AGGREGATIONS: tuple[str, ...] = get_args(LossAggregation)


@dataclass(frozen=True)
class LossNormalizer:
    """Denominators of the aggregation, counted over the whole (global) batch."""

    tokens: float
    """Loss tokens."""
    sequences: float
    """Sequences with at least one loss token."""
    total_sequences: float
    """All sequences, including fully masked ones."""

    @classmethod
    def from_mask(
        cls, mask: torch.Tensor, episode_ids: torch.Tensor | None = None
    ) -> LossNormalizer:
        """The normaliser of a batch on its own (one host sync); with ``episode_ids`` the
        sequences counted are episodes (rows sharing an id are one sequence)."""
        mask = mask.bool()
        if episode_ids is None:
            counts = torch.stack([mask.sum(), mask.any(dim=1).sum()]).tolist()
            return cls(tokens=counts[0], sequences=counts[1], total_sequences=mask.shape[0])
        with_tokens, episodes = episode_counts(mask, episode_ids)
        counts = torch.stack([mask.sum(), with_tokens, episodes]).tolist()
        return cls(tokens=counts[0], sequences=counts[1], total_sequences=counts[2])


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: LossAggregation,
    normalizer: LossNormalizer,
    max_tokens: int,
    seq_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scalar loss from per-token ``values`` [B, T]; positions outside ``mask`` are ignored.

    ``seq_tokens`` [B]: the loss tokens of the sequence each row belongs to, the
    ``seq-mean-token-mean`` denominator; default the row's own count. For segments of an
    episode pass their episode's total (`episode_loss_tokens` of the whole batch), since a
    micro-batch may hold only some of the segments.
    """
    mask = mask.bool()
    if mode == "token-mean":
        return masked_sum(values, mask) / max(normalizer.tokens, 1.0)
    per_seq = masked_sum(values, mask, dim=1)
    if mode == "seq-mean-token-mean":
        if seq_tokens is None:
            seq_tokens = mask.sum(1)
        elif seq_tokens.shape != per_seq.shape:
            raise GRPOError(
                f"seq_tokens has shape {tuple(seq_tokens.shape)}, expected {tuple(per_seq.shape)}"
            )
        per_seq = per_seq / seq_tokens.clamp(min=1)
        return per_seq.sum() / max(normalizer.sequences, 1.0)
    if mode == "seq-mean-token-sum":
        return per_seq.sum() / max(normalizer.sequences, 1.0)
    if mode == "constant":
        return per_seq.sum() / (float(max_tokens) * max(normalizer.total_sequences, 1.0))
    raise GRPOError(f"unknown loss aggregation {mode!r}; use one of {LOSS_AGGREGATIONS}")
