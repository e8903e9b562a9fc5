"""Segment chains for the tests: cut episodes into prompted segments, a bigram policy that
scores a segment as its episode, and a step on either.

An episode (row) is cut the way a self-summarising agent's would be: each piece of its
tokens becomes a row with its own prompt (outside the loss), and every segment carries the
episode's id, group and reward. Loaded by conftest.py as the ``chains`` fixture.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator

from tandem.grpo import GRPOConfig, GRPOStep, RolloutBatch


@dataclass
class Split:
    """Where each position of the split rows comes from in the unsplit rows."""

    src_row: torch.Tensor  # [R] the episode (unsplit row) of each segment
    src_pos: torch.Tensor  # [R, Tn] position in the unsplit row (0 where not valid)
    valid: torch.Tensor  # [R, Tn] the position copies an unsplit position
    own: torch.Tensor  # [R, Tn] ... and is one of this segment's own tokens (not its context)
    real: torch.Tensor  # [R, Tn] a real token (copied or the segment's own prompt)

    def take(self, x: torch.Tensor, fill: float | int | bool) -> torch.Tensor:
        """A per-token [B, T] tensor of the unsplit rows laid out as the segments [R, Tn]
        (differentiable: gradients flow back to ``x``)."""
        picked = x[self.src_row[:, None], self.src_pos]
        return torch.where(self.valid, picked, torch.full_like(picked, fill))

    def mask(self, mask: torch.Tensor) -> torch.Tensor:
        return self.take(mask, False) & self.own

    def episode_ids(self) -> torch.Tensor:
        """Sparse, non-contiguous ids, so the mapping to dense episodes is exercised too."""
        return 1000 - 7 * self.src_row


def cut(num_rows: int, length: int, cuts: dict[int, list[int]], gen: torch.Generator) -> Split:
    """Cut row i at the positions ``cuts[i]``: the piece [a, b) becomes a row whose prompt is
    0-2 fresh tokens plus the token at a - 1 (the context a bigram policy needs), all outside
    the loss; the first piece keeps the row's own prompt. The pieces come out shuffled, so
    the segments of an episode are not neighbours."""
    pieces: list[tuple[int, list[tuple[int, bool]], int]] = []  # (row, [(pos, own)], extra)
    for i in range(num_rows):
        bounds = [0, *cuts.get(i, []), length]
        for a, b in itertools.pairwise(bounds):
            if a == 0:
                pieces.append((i, [(t, True) for t in range(b)], 0))
            else:
                extra = int(torch.randint(0, 3, (), generator=gen))
                pieces.append((i, [(a - 1, False)] + [(t, True) for t in range(a, b)], extra))
    width = max(extra + len(pos) for _, pos, extra in pieces)
    r = len(pieces)
    src_pos = torch.zeros(r, width, dtype=torch.long)
    valid = torch.zeros(r, width, dtype=torch.bool)
    own = torch.zeros(r, width, dtype=torch.bool)
    real = torch.zeros(r, width, dtype=torch.bool)
    for k, (_, positions, extra) in enumerate(pieces):
        real[k, : extra + len(positions)] = True
        for j, (t, is_own) in enumerate(positions):
            src_pos[k, extra + j], valid[k, extra + j], own[k, extra + j] = t, True, is_own
    order = torch.randperm(r, generator=gen)
    src_row = torch.tensor([p[0] for p in pieces])
    return Split(src_row[order], src_pos[order], valid[order], own[order], real[order])


def episode_of(episode_ids: torch.Tensor) -> torch.Tensor:
    """The unsplit row of each segment, from its `Split.episode_ids` id."""
    return (1000 - episode_ids) // 7


def spans_micro_batches(episode_ids: torch.Tensor, sizes: list[int]) -> bool:
    """Whether some episode has segments in two of the consecutive micro-batches ``sizes``."""
    chunk = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    return any(chunk[episode_ids == e].unique().numel() > 1 for e in episode_ids.unique().tolist())


V, L = 7, 12  # vocabulary, tokens per unsplit episode
GROUPS, PER_GROUP = 4, 3
EPISODE_CUTS = {0: [4, 8], 1: [6], 3: [5], 5: [2, 10], 6: [3, 5, 9], 9: [7], 10: [11]}


class Bigram(torch.nn.Module):
    """Next-token logits from the current token only, so a segment whose prompt ends with
    the token before its first own token scores its tokens exactly as the unsplit episode
    does: the step on segments must then equal the step on episodes."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(V, V)

    def forward(
        self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.table(ids)


def episodes_batch(seed: int = 0) -> RolloutBatch:
    """Four groups of three episodes: varied rewards, all equal, varied, all failed."""
    gen = torch.Generator().manual_seed(seed)
    n = GROUPS * PER_GROUP
    pos = torch.arange(L)
    length = torch.randint(8, L + 1, (n, 1), generator=gen)
    attention = pos < length
    mask = attention & (pos >= 2) & (torch.rand(n, L, generator=gen) < 0.8)
    mask[2] = False  # an empty episode
    rollout = -torch.rand(n, L, generator=gen, dtype=torch.float64) * 2
    return RolloutBatch(
        input_ids=torch.randint(0, V, (n, L), generator=gen),
        loss_mask=mask,
        rollout_logprobs=rollout,
        rewards=torch.tensor(
            [1.0, 0.0, 0.5, 1.0, 1.0, 1.0, 0.2, 0.9, 0.9, 0.0, 0.0, 0.0], dtype=torch.float64
        ),
        group_ids=torch.arange(GROUPS).repeat_interleave(PER_GROUP) + 10,
        policy_version=torch.zeros(n, dtype=torch.long),
        attention_mask=attention,
        ref_logprobs=rollout + 0.1 * torch.randn(n, L, generator=gen, dtype=torch.float64),
    )


def split_batch(batch: RolloutBatch, seed: int = 1) -> RolloutBatch:
    """The episodes of ``batch`` cut at `EPISODE_CUTS` into shuffled, prompted segments."""
    gen = torch.Generator().manual_seed(seed)
    split = cut(batch.num_sequences, L, EPISODE_CUTS, gen)
    junk = torch.randint(0, V, split.valid.shape, generator=gen)
    assert batch.attention_mask is not None and batch.ref_logprobs is not None
    return RolloutBatch(
        input_ids=torch.where(split.valid, split.take(batch.input_ids, 0), junk),
        loss_mask=split.mask(batch.loss_mask),
        rollout_logprobs=split.take(batch.rollout_logprobs, 0.0),
        rewards=batch.rewards[split.src_row],
        group_ids=batch.group_ids[split.src_row],
        policy_version=batch.policy_version[split.src_row],
        attention_mask=split.real & (~split.valid | split.take(batch.attention_mask, False)),
        ref_logprobs=split.take(batch.ref_logprobs, 0.0),
        episode_ids=split.episode_ids(),
    )


def run(
    batch: RolloutBatch, cfg: GRPOConfig, shards: int = 1
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    torch.manual_seed(0)
    model = Bigram().double()
    step = GRPOStep(model, torch.optim.SGD(model.parameters(), lr=0.5), cfg, Accelerator(cpu=True))
    metrics = step.step(batch, shards=shards)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, metrics


VARIANTS: dict[str, dict[str, Any]] = {
    "dr-grpo": {"kl_coef": 0.05},
    "grpo-kl-reward": {
        "std_normalize": True,
        "leave_one_out": True,
        "kl_coef": 0.05,
        "kl_placement": "reward",
        "failed_group_advantage": -0.2,
        "max_grad_norm": 0.02,  # clipping engaged: the gradient norms must agree too
    },
}


def config(agg: str, variant: str) -> GRPOConfig:
    settings = {"loss_agg": agg, "max_tokens": L, "micro_batch_size": 3, "max_grad_norm": None}
    return GRPOConfig(**{**settings, **VARIANTS[variant]})
