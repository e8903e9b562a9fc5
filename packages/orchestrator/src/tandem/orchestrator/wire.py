"""What crosses between the pipeline's parts and processes: turns, trajectories, groups, figures.

An engine answers a turn with a `TurnOutput`; an episode becomes a `Sample` (the exact token
ids, the engine's log-probs, the policy version of every token and the experts every fed
token was routed to); a GRPO group is a `Group`; a rollout worker returns a `PlayedGroup`
and reports its engine's `RolloutStats`. All are msgspec Structs; `encode` and `decode` turn
them into msgpack bytes and back (numpy arrays as dtype, shape and raw bytes), which is how
groups travel between Ray actors and the driver.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import msgspec
import numpy as np

T = TypeVar("T")

_NDARRAY = 1  # msgpack extension code of a numpy array


class TurnOutput(msgspec.Struct, kw_only=True, eq=False):
    """What one generation request produced.

    ``routes`` [fed tokens, layers, top_k]: experts of each token fed in this request, in
    order. ``versions[i]``: policy version whose logits sampled ``tokens[i]``.
    ``min_version``/``max_version`` cover every forward that touched the sequence in this
    request (prefill included). ``truncated``: stopped by the token budget, not by the stop
    token.
    """

    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    routes: np.ndarray
    min_version: int
    max_version: int
    truncated: bool


class Segment(msgspec.Struct, kw_only=True, eq=False):
    """One context of an episode: one training sequence (fields as in `Sample`).

    An episode whose context was compacted is a chain of them: each ended where the policy
    summarised (or the window slid), and the next began from a fresh prompt."""

    tokens: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    routes: np.ndarray
    min_version: int
    max_version: int


class Compaction(msgspec.Struct, kw_only=True, frozen=True):
    """One compaction of an episode's context: ``replaced``, the tokens of the context it
    ended; ``kept``, the tokens of the fresh context's prompt; ``summary``, the summary's
    tokens (0 when the window slid); ``cut``, the summary reached its budget."""

    replaced: int
    kept: int
    summary: int = 0
    cut: bool = False


class Sample(msgspec.Struct, kw_only=True, eq=False):
    """One scored trajectory as the trainer needs it.

    ``routes`` [len(tokens) - 1, layers, top_k]: experts of every token but the last (the
    last token is sampled, never fed, and predicts nothing). ``versions[i]`` is the policy
    version that sampled token i (-1 for tokens the policy did not generate).

    An episode that compacted its context keeps its earlier contexts in ``prior_segments``
    (in order; the fields above are its last context) and each compaction in
    ``compactions``. ``min_version``/``max_version`` cover every segment;
    ``last_min_version``/``last_max_version`` the last one (-1: the same).
    """

    task_id: str
    tokens: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    routes: np.ndarray
    reward: float
    resolved: bool
    turns: int
    termination: str
    min_version: int
    max_version: int
    format_errors: int = 0
    tool_errors: int = 0
    infra_fault: bool = False
    wall_s: float = 0.0
    messages: list[dict[str, Any]] = []
    prior_segments: list[Segment] = []
    compactions: list[Compaction] = []
    last_min_version: int = -1
    last_max_version: int = -1

    @property
    def generated_tokens(self) -> int:
        return sum(self.loss_mask) + sum(sum(s.loss_mask) for s in self.prior_segments)

    def segments(self) -> list[Segment]:
        """The episode's training sequences, in order (one unless it compacted)."""
        last = Segment(
            tokens=self.tokens,
            loss_mask=self.loss_mask,
            logprobs=self.logprobs,
            versions=self.versions,
            routes=self.routes,
            min_version=self.min_version if self.last_min_version < 0 else self.last_min_version,
            max_version=self.max_version if self.last_max_version < 0 else self.last_max_version,
        )
        return [*self.prior_segments, last]


class Group(msgspec.Struct, frozen=True):
    """The samples of one prompt and the policy version the group counts as (the staleness
    rule's `group_version`: the oldest among their tokens)."""

    samples: list[Sample]
    policy_version: int


def has_signal(rewards: Sequence[float], train_failed: bool = False) -> bool:
    """Whether a group with these rewards trains the policy: its rewards differ, or (with
    ``train_failed``, grpo's ``failed_group_advantage``) there are two or more and none is
    above 0. The group filter and the curriculum both ask it."""
    if len(set(rewards)) > 1:
        return True
    return train_failed and len(rewards) >= 2 and max(rewards) <= 0


def compaction_figures(samples: Sequence[Sample]) -> dict[str, float]:
    """Per-episode means over ``samples``: compactions, and each summary's tokens against
    the context it replaced (means over the compactions; 0 where there were none), and the
    share of summaries cut at their budget."""
    records = [c for s in samples for c in s.compactions]
    summaries = [c for c in records if c.summary]
    n = max(len(samples), 1)
    return {
        "compactions": len(records) / n,
        "summary_tokens": sum(c.summary for c in summaries) / max(len(summaries), 1),
        "replaced_tokens": sum(c.replaced for c in records) / max(len(records), 1),
        "summaries_cut": sum(c.cut for c in summaries) / max(len(summaries), 1),
    }


class PlayedGroup(msgspec.Struct, kw_only=True):
    """The outcome of one group: its samples, or why it was dropped (``dropped`` non-empty:
    episodes cut past their budget, or a sandbox that failed to start)."""

    index: int
    samples: list[Sample] = []
    dropped: str = ""
    cut: int = 0


class RolloutStats(msgspec.Struct, kw_only=True):
    """Inference-side figures for the step metrics (summed or merged over engines)."""

    tokens_sampled: int = 0
    tokens_fed: int = 0
    tokens_reused: int = 0
    engine_version: int = -1
    pause_s: list[float] = []
    prepare_s: list[float] = []
    sync_bytes: int = 0
    pull_failures: int = 0
    workers: int = 1
    busy_s: float = 0.0
    """Seconds in engine steps (prefill, decode, swaps), summed over engines."""

    @staticmethod
    def merge(parts: list[RolloutStats]) -> RolloutStats:
        """Several engines as one: counters add up, the version is the laggard's."""
        out = RolloutStats(workers=len(parts))
        for p in parts:
            out.tokens_sampled += p.tokens_sampled
            out.tokens_fed += p.tokens_fed
            out.tokens_reused += p.tokens_reused
            out.pause_s += p.pause_s
            out.prepare_s += p.prepare_s
            out.sync_bytes += p.sync_bytes
            out.pull_failures += p.pull_failures
            out.busy_s += p.busy_s
        out.engine_version = min((p.engine_version for p in parts), default=-1)
        return out


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        array = np.ascontiguousarray(obj)
        header = msgspec.msgpack.encode((array.dtype.str, array.shape))
        payload = len(header).to_bytes(4, "little") + header + array.tobytes()
        return msgspec.msgpack.Ext(_NDARRAY, payload)
    raise TypeError(f"cannot send an object of type {type(obj).__name__} between processes")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code != _NDARRAY:
        raise NotImplementedError(f"unknown msgpack extension {code}")
    n = int.from_bytes(data[:4], "little")
    dtype, shape = msgspec.msgpack.decode(data[4 : 4 + n], type=tuple[str, tuple[int, ...]])
    return np.frombuffer(data[4 + n :], dtype=np.dtype(dtype)).reshape(shape).copy()


def encode(obj: Any) -> bytes:
    """msgpack bytes of a wire message (or a list of them)."""
    return msgspec.msgpack.encode(obj, enc_hook=_enc_hook)


def decode(data: bytes, type_: type[T]) -> T:
    """The message of type ``type_`` in ``data`` (as `encode` made it)."""
    return msgspec.msgpack.decode(data, type=type_, ext_hook=_ext_hook)
