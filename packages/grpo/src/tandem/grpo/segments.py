"""Segment chains: one episode spread over several rows of a batch.

When an agent episode outgrows the context window, the policy writes a summary and the
episode goes on in a fresh context (Composer's self-summary, verl's context managers). Each
context is one training row, a *segment*: its prompt plus what the policy sampled in it, the
summary included. Rows sharing a `RolloutBatch.episode_ids` value are the segments of one
episode; without ids every row is its own episode.

The episode, not the row, is the unit the policy is rewarded for, so it is also the unit of

- advantages: group statistics (mean, std, the equal-reward and failed-group filters) count
  each episode once, and every segment carries its episode's advantage;
- sequence-level loss aggregation: an episode's segments are summed as one sequence (see
  `aggregation`), so an episode weighs the same however many times it was summarised.

Segments of one episode must share its group and reward (checked here, `GRPOError` naming
the field). They may sit anywhere in the batch and in different micro-batches: everything
that spans an episode (its loss tokens, the episode counts) is counted on the whole batch
before the micro-batches run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from tandem.grpo.errors import GRPOError


def check_episode_ids(episode_ids: torch.Tensor, num_rows: int) -> None:
    """Raise `GRPOError` unless ``episode_ids`` is an integer tensor of shape (num_rows,)."""
    if not isinstance(episode_ids, torch.Tensor):
        raise GRPOError(f"episode_ids must be a tensor, got {type(episode_ids).__name__}")
    if episode_ids.shape != (num_rows,):
        raise GRPOError(
            f"episode_ids has shape {tuple(episode_ids.shape)}, expected ({num_rows},): "
            "one episode id per row"
        )
    if (
        episode_ids.is_floating_point()
        or episode_ids.is_complex()
        or episode_ids.dtype == torch.bool
    ):
        raise GRPOError(f"episode_ids must be an integer tensor, got {episode_ids.dtype}")


@dataclass(frozen=True)
class Episodes:
    """Which rows are segments of which episode, as dense indices.

    ``index[b]`` is the episode (in [0, count)) of row b; ``first[e]`` is the row of episode
    e's first segment in batch order, which stands for the episode wherever one value per
    episode is needed (its reward, its group).
    """

    index: torch.Tensor
    count: int
    first: torch.Tensor

    @classmethod
    def of(
        cls, episode_ids: torch.Tensor | None, num_rows: int, device: torch.device | None = None
    ) -> Episodes:
        """The episodes of ``num_rows`` rows; each row its own episode when ids are None."""
        if episode_ids is None:
            rows = torch.arange(num_rows, device=device)
            return cls(index=rows, count=num_rows, first=rows)
        check_episode_ids(episode_ids, num_rows)
        unique, index = torch.unique(episode_ids, return_inverse=True)
        index = index.to(device if device is not None else episode_ids.device)
        count = int(unique.numel())
        rows = torch.arange(num_rows, device=index.device)
        first = torch.full((count,), num_rows, dtype=torch.long, device=index.device)
        first = first.scatter_reduce(0, index, rows, reduce="amin")
        return cls(index=index, count=count, first=first)

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """One value per episode [E]: the value of its first segment."""
        return values[self.first]

    def spread(self, per_episode: torch.Tensor) -> torch.Tensor:
        """Back to rows [B]: every segment gets its episode's value."""
        return per_episode[self.index]

    def sums(self, values: torch.Tensor) -> torch.Tensor:
        """Sum over each episode's segments [E, ...] of per-row ``values`` [B, ...]."""
        out = torch.zeros((self.count, *values.shape[1:]), dtype=values.dtype, device=values.device)
        return out.index_add_(0, self.index, values)

    def first_rows(self) -> torch.Tensor:
        """Bool [B]: True on the row that stands for its episode (its first segment)."""
        out = torch.zeros(self.index.shape[0], dtype=torch.bool, device=self.index.device)
        out[self.first] = True
        return out

    def check_agree(self, name: str, values: torch.Tensor) -> None:
        """Raise `GRPOError` naming ``name`` if segments of one episode hold different values
        (NaN agrees with NaN here; non-finite values are rejected where they are used)."""
        ref = self.spread(self.gather(values))
        differ = values != ref
        if values.is_floating_point():
            differ &= ~(torch.isnan(values) & torch.isnan(ref))
        if differ.any():
            row = int(differ.nonzero()[0, 0])
            other = int(self.first[self.index[row]])
            raise GRPOError(
                f"{name} differ between segments of one episode (rows {other} and {row} share "
                f"an episode id but have {name} {values[other].item()!r} and "
                f"{values[row].item()!r}); every segment must carry its episode's {name}"
            )


def check_segments(
    episode_ids: torch.Tensor,
    group_ids: torch.Tensor,
    rewards: torch.Tensor,
    advantages: torch.Tensor | None = None,
) -> Episodes:
    """Check that the segments of each episode agree on group, reward (and given advantage);
    returns the `Episodes`. Raises `GRPOError` naming the field that disagrees."""
    episodes = Episodes.of(episode_ids, int(group_ids.shape[0]), group_ids.device)
    episodes.check_agree("group_ids", group_ids)
    episodes.check_agree("rewards", rewards)
    if advantages is not None:
        episodes.check_agree("advantages", advantages)
    return episodes


def episode_loss_tokens(mask: torch.Tensor, episode_ids: torch.Tensor | None) -> torch.Tensor:
    """Int64 [B]: the loss tokens of each row's episode, all its segments together (the
    row's own count when ``episode_ids`` is None). The per-sequence denominator of
    ``seq-mean-token-mean``; count it on the whole batch, then slice it with the rows."""
    mask = mask.bool()
    per_row = mask.sum(1)
    if episode_ids is None:
        return per_row
    episodes = Episodes.of(episode_ids, int(mask.shape[0]), mask.device)
    return episodes.spread(episodes.sums(per_row))


def episode_counts(
    mask: torch.Tensor, episode_ids: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(episodes with at least one loss token, episodes) among the rows of ``mask`` [B, T],
    as 0-d int64 tensors; rows count as episodes when ``episode_ids`` is None.

    Rows with no loss token still count as episodes (the ``constant`` aggregation divides by
    every sequence), so pass only the rows that train (e.g. of the kept groups)."""
    mask = mask.bool()
    if episode_ids is None:
        return mask.any(dim=1).sum(), torch.tensor(mask.shape[0], device=mask.device)
    episodes = Episodes.of(episode_ids, int(mask.shape[0]), mask.device)
    with_tokens = (episodes.sums(mask.sum(1)) > 0).sum()
    return with_tokens, torch.tensor(episodes.count, device=mask.device)


@dataclass(frozen=True)
class StepEpisodes:
    """What a trainer step counts per episode, on its whole (per-process) batch."""

    with_tokens: torch.Tensor
    """0-d: kept episodes with at least one loss token (the sequence-mean count)."""
    kept: torch.Tensor
    """0-d: kept episodes (the ``constant`` aggregation's count)."""
    total: torch.Tensor
    """0-d: all episodes of the batch, kept or not (the reward mean's count)."""
    rewards: torch.Tensor
    """One reward per episode."""
    seq_tokens: torch.Tensor | None
    """Int64 [B]: each row's episode's kept loss tokens; None when rows are episodes."""
    counted: torch.Tensor | None
    """Bool [B]: the row that stands for its episode in per-episode sums; None: every row."""


def step_episodes(
    kept_mask: torch.Tensor,
    keep: torch.Tensor,
    rewards: torch.Tensor,
    episode_ids: torch.Tensor | None,
) -> StepEpisodes:
    """The episode counts of a step whose kept rows are ``keep`` (whole groups, so whole
    episodes) and loss mask on them ``kept_mask``. Without ``episode_ids`` they are the row
    counts the step always used, computed the same way."""
    if episode_ids is None:
        total = torch.tensor(int(keep.shape[0]), device=keep.device)
        return StepEpisodes(kept_mask.any(1).sum(), keep.sum(), total, rewards, None, None)
    episodes = Episodes.of(episode_ids, int(keep.shape[0]), keep.device)
    with_tokens, kept = episode_counts(kept_mask[keep], episode_ids[keep])
    return StepEpisodes(
        with_tokens=with_tokens,
        kept=kept,
        total=torch.tensor(episodes.count, device=keep.device),
        rewards=episodes.gather(rewards),
        seq_tokens=episodes.spread(episodes.sums(kept_mask.sum(1))),
        counted=episodes.first_rows(),
    )


class RowTerms(NamedTuple):
    """Per-row inputs of a step's micro-batches, sliced with their rows: advantages, each
    row's episode's loss tokens (None: the row's own) and the rows counted once per episode
    in per-episode metrics (None: every row)."""

    adv: torch.Tensor
    seq_tokens: torch.Tensor | None
    counted: torch.Tensor | None

    def select(self, rows: torch.Tensor) -> RowTerms:
        return RowTerms(*(None if t is None else t[rows] for t in self))
