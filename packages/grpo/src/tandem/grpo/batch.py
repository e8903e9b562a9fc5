"""`RolloutBatch`, the trainer's input, and the forward-hook contract.

A batch is a set of scored trajectories, padded on the right to a common length T. Multi-turn
agent trajectories are stored as one token sequence each (prompt, the policy's turns, tool
outputs, ...) with a loss mask that is True only on the tokens the policy generated.

Alignment convention (the one every causal LM uses): per-token tensors are indexed by the
position of the *token*, so ``rollout_logprobs[b, t] = log pi(input_ids[b, t] |
input_ids[b, :t])``. Position 0 has no prediction and must be outside the loss mask.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from tandem.grpo.errors import GRPOError
from tandem.grpo.numerics import as_float
from tandem.grpo.segments import check_segments


@dataclass
class RolloutBatch:
    """Scored trajectories, one row each (B rows, T token positions).

    Attributes:
        input_ids: [B, T] int64 token ids, the exact ids the engine saw and produced.
        loss_mask: [B, T] bool, True on policy-generated tokens (the loss covers only these).
        rollout_logprobs: [B, T] float log-probs the inference engine reported for the
            sampled tokens (values outside ``loss_mask`` are ignored).
        rewards: [B] float scalar reward per trajectory.
        group_ids: [B] int64, equal for the samples of one prompt. Groups must be complete
            in the batch a process receives (see `shard_by_group`).
        policy_version: [B] int64, the oldest policy version that produced the trajectory.
        attention_mask: [B, T] bool, True on real (non-padding) tokens; defaults to all True.
        old_logprobs: [B, T] optional trainer log-probs of the policy the PPO ratio is taken
            against (e.g. a recomputed old-policy pass). When absent the ratio is taken
            against the current weights (one optimizer step per batch, so it is exactly 1
            with the right gradient).
        ref_logprobs: [B, T] optional reference-policy log-probs (KL penalty).
        advantages: [B] optional precomputed advantages; when absent they are computed from
            the rewards with the configured group estimator.
        extras: tensors with a leading batch dimension B that the forward hook needs (e.g.
            a padded routing trace [B, T, layers, top_k] for router replay). They are sliced
            along dim 0 with the rows; anything else in here is passed through untouched.
        episode_ids: [B] optional int64 episode of each row. Rows sharing an id are the
            segments of one episode that was summarised into fresh contexts (see
            `tandem.grpo.segments`): they must share its group id and reward, get its
            advantage, and count as one sequence in the loss aggregation. None: every row is
            its own episode.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    rewards: torch.Tensor
    group_ids: torch.Tensor
    policy_version: torch.Tensor
    attention_mask: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    episode_ids: torch.Tensor | None = None

    @property
    def num_sequences(self) -> int:
        return int(self.input_ids.shape[0])

    def validate(self) -> None:
        """Check shapes, dtypes and the alignment convention; raise `GRPOError` if wrong."""
        if self.input_ids.dim() != 2 or self.input_ids.is_floating_point():
            raise GRPOError(
                f"input_ids must be an integer [batch, tokens] tensor, got "
                f"{self.input_ids.dtype} of shape {tuple(self.input_ids.shape)}"
            )
        b, t = self.input_ids.shape
        for name in (
            "loss_mask",
            "rollout_logprobs",
            "attention_mask",
            "old_logprobs",
            "ref_logprobs",
        ):
            value = getattr(self, name)
            if value is not None and value.shape != (b, t):
                raise GRPOError(f"{name} has shape {tuple(value.shape)}, expected ({b}, {t})")
        for name in ("rewards", "group_ids", "policy_version", "advantages"):
            value = getattr(self, name)
            if value is not None and value.shape != (b,):
                raise GRPOError(f"{name} has shape {tuple(value.shape)}, expected ({b},)")
        if self.loss_mask.dtype != torch.bool:
            raise GRPOError(f"loss_mask must be bool, got {self.loss_mask.dtype}")
        if t and self.loss_mask[:, 0].any():
            raise GRPOError(
                "loss_mask[:, 0] is True: the first token has no prediction (log-probs are "
                "aligned with the token they score); start the loss at the first generated token"
            )
        if self.attention_mask is not None and (self.loss_mask & ~self.attention_mask.bool()).any():
            raise GRPOError("loss_mask covers padding (attention_mask False) positions")
        for name, value in self.extras.items():
            if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] != b:
                raise GRPOError(
                    f"extras[{name!r}] has leading dimension {value.shape[0]}, expected {b}"
                )
        if self.episode_ids is not None:
            check_segments(self.episode_ids, self.group_ids, self.rewards, self.advantages)

    def select(self, rows: torch.Tensor | slice) -> RolloutBatch:
        """The sub-batch of the given rows (an index tensor, a bool mask or a slice)."""

        def take(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.dim():
                return value[rows]
            return value

        fields = {f.name: take(getattr(self, f.name)) for f in dataclasses.fields(self)}
        fields["extras"] = {k: take(v) for k, v in self.extras.items()}
        return RolloutBatch(**fields)

    def to(self, device: torch.device | str) -> RolloutBatch:
        """A copy with every tensor moved to ``device``."""

        def move(value: Any) -> Any:
            return value.to(device) if isinstance(value, torch.Tensor) else value

        fields = {f.name: move(getattr(self, f.name)) for f in dataclasses.fields(self)}
        fields["extras"] = {k: move(v) for k, v in self.extras.items()}
        return RolloutBatch(**fields)


def shard_by_group(batch: RolloutBatch, rank: int, world_size: int) -> RolloutBatch:
    """The rows of ``batch`` that process ``rank`` of ``world_size`` trains on.

    Whole groups are dealt round-robin in order of first appearance, so each process can
    compute group advantages locally and the union of the shards is the batch. The segments
    of an episode share its group (`RolloutBatch.validate`), so they stay on one process.
    """
    if not 0 <= rank < world_size:
        raise GRPOError(f"rank {rank} is not in [0, {world_size})")
    return batch.select((group_owners(batch, world_size) == rank).nonzero().flatten())


def group_owners(batch: RolloutBatch, world_size: int) -> torch.Tensor:
    """The process (of ``world_size``) that trains each row: see `shard_by_group`."""
    _, index = torch.unique(batch.group_ids, return_inverse=True)
    order: dict[int, int] = {}
    for g in index.tolist():
        order.setdefault(g, len(order))
    return torch.tensor([order[g] % world_size for g in index.tolist()], dtype=torch.long)


class ForwardOutput(NamedTuple):
    """What a forward hook returns: per-token log-probs [b, T], optional entropy [b, T], and
    the optional exact KL to the reference [b, T] that ``kl_estimator='forward'`` needs (the
    hook holds the reference's whole distributions; the loss only sees these numbers)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None = None
    kl: torch.Tensor | None = None


ForwardFn = Callable[[torch.nn.Module, RolloutBatch], "ForwardOutput | torch.Tensor"]
"""``forward_fn(model, micro_batch) -> ForwardOutput | logprobs``.

Called once per micro-batch with gradients enabled. It must return the log-probs of
``micro_batch.input_ids`` under ``model``, aligned as in `RolloutBatch` (position 0 unused),
as a [b, T] tensor that requires grad. This is where router replay plugs in: read the
routing trace from ``micro_batch.extras`` and run the MoE with it.
"""


def next_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Log-probs [B, T] of ``input_ids`` under next-token ``logits`` [B, T, V] (position 0 = 0)."""
    b, t, v = logits.shape
    shifted = as_float(logits[:, :-1].reshape(-1, v))
    lp = -F.cross_entropy(shifted, input_ids[:, 1:].reshape(-1), reduction="none")
    return F.pad(lp.view(b, t - 1), (1, 0))


def token_entropy(logits: torch.Tensor, *, grad: bool = False) -> torch.Tensor:
    """Entropy [B, T] of the next-token distribution that scores each token (position 0 = 0).

    Without ``grad`` it is a metric and costs no backward memory.
    """
    with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
        logp = torch.log_softmax(as_float(logits[:, :-1]), dim=-1)
        ent = -(logp.exp() * logp).sum(-1)
        return F.pad(ent, (1, 0))


def causal_lm_forward(
    model: torch.nn.Module,
    batch: RolloutBatch,
    *,
    with_entropy: bool = True,
    entropy_grad: bool = False,
) -> ForwardOutput:
    """Default hook for causal LMs: ``model(input_ids, attention_mask=...)`` returning logits
    [B, T, V] (or an object with ``.logits``, as Hugging Face models do).

    Entropy is a metric computed without gradient unless ``entropy_grad`` (the trainer sets
    it when ``entropy_coef > 0``).
    """
    kwargs = {} if batch.attention_mask is None else {"attention_mask": batch.attention_mask}
    out = model(batch.input_ids, **kwargs)
    logits = getattr(out, "logits", out)
    entropy = token_entropy(logits, grad=entropy_grad) if with_entropy else None
    return ForwardOutput(next_token_logprobs(logits, batch.input_ids), entropy)
