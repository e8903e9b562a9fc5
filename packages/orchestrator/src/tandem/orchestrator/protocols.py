"""The interfaces between the pipeline's roles.

The RL loop (`tandem.orchestrator.rl`) drives a `Backend`: its `Rollouts` (engines playing
GRPO groups and following the weight stream), its `Trainer` (one optimizer step per call)
and its `WeightSink` (publishing each policy version). It picks tasks through a
`TaskCursor` (its schedules, in `rl.schedule`, decide when groups play). An episode drives
an `Engine` turn by turn. Each backend (``local``, ``ray``) and each engine implements
these, and the loop imports nothing else of theirs: a new engine or backend is one new
module.

The policy version is the loop's: it passes the version to `Trainer.step` and
`WeightSink.try_publish`, and counts an applied step; nothing else writes it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from tandem.agent_env import Task
from tandem.orchestrator.wire import PlayedGroup, RolloutStats, Sample, TurnOutput

if TYPE_CHECKING:
    import torch

    from tandem.delta_sync import PublishReport
    from tandem.orchestrator.artifacts.checkpoint import Checkpoint

State = dict[str, "torch.Tensor"]
"""Tensors by name: a policy's weights."""


class EngineStopped(RuntimeError):
    """The engine has stopped serving (closed, or it failed): no turn will finish."""


class WorkerLost(RuntimeError):
    """A rollout worker died with groups in flight; they are played again elsewhere."""


class Engine(Protocol):
    """What an episode drives: one context (a slot) per episode, turns fed token by token.

    `generate` feeds the tokens the slot has not seen yet and samples until the stop token,
    the budget, or the first token ``keep_going`` rejects; earlier turns are never fed again.
    """

    @property
    def max_len(self) -> int:
        """The longest context a slot holds (prompt, turns and observations)."""
        ...

    async def acquire(self) -> int: ...

    def release(self, slot: int) -> None: ...

    async def generate(
        self,
        slot: int,
        feed: list[int],
        generator: torch.Generator,
        max_new_tokens: int,
        keep_going: Callable[[int], bool] | None = None,
    ) -> TurnOutput: ...


class Rollouts(Protocol):
    """The inference side of a run: engines that play GRPO groups and follow the weights.

    ``play`` raises `WorkerLost` when the worker playing the group is gone (the loop plays
    the group again) and returns a `PlayedGroup` whose ``dropped`` says why a group was
    given up (an episode past its budget, a sandbox that failed).
    """

    @property
    def version(self) -> int:
        """The policy version every engine holds at least (the laggard's)."""
        ...

    async def start(self, *, follow: bool) -> list[asyncio.Task[Any]]:
        """Start serving; with ``follow`` the engines pull each new version by themselves.
        Returns the background tasks (a crash in one stops the run)."""
        ...

    async def play(self, index: int, min_version: int = -1) -> PlayedGroup:
        """Task ``index``'s group, on an engine holding at least ``min_version``."""
        ...

    def published(self) -> None:
        """A newer version is in the store."""
        ...

    async def sync_to(self, version: int) -> None:
        """Every engine on ``version`` (pulled now)."""
        ...

    async def stats(self) -> RolloutStats: ...

    async def close(self) -> None: ...


class Trainer(Protocol):
    """One optimizer step per call on whole groups, from the weights of ``version``."""

    def step(self, groups: Sequence[Sequence[Sample]], version: int) -> dict[str, Any]:
        """Metrics of the step; ``step_applied`` is 1.0 when the weights changed."""
        ...

    def weights(self) -> State:
        """The whole current weights (gathered where the trainer is sharded)."""
        ...

    def checkpoint_state(self) -> tuple[State, dict[str, Any]]:
        """(whole weights, whole optimizer state) for a checkpoint."""
        ...

    def close(self) -> None: ...


class WeightSink(Protocol):
    """Where each policy version goes (a delta-sync stream). A failed publish leaves the
    version ``pending``; the loop retries it."""

    pending: int | None
    failures: int
    reports: list[PublishReport]

    def publish(self, version: int) -> PublishReport:
        """Publish the trainer's current weights as ``version`` (raises if the store fails)."""
        ...

    def try_publish(self, version: int) -> PublishReport | None:
        """`publish`, or None when the store failed (then ``pending`` is set)."""
        ...

    def close(self) -> None: ...


class Backend(Protocol):
    """Where a run's engines and trainer live, built for one run by a `BackendFactory`."""

    rollouts: Rollouts
    trainer: Trainer
    sink: WeightSink

    async def close(self) -> None:
        """Stop everything the backend started; the run's policy then holds the weights."""
        ...


@dataclass(frozen=True)
class BackendStart:
    """Where the run starts: the policy version, the weight stream (a fresh one after each
    resume) and, when resuming, the checkpoint (weights and optimizer state)."""

    version: int
    stream: int
    resume: Checkpoint | None = None
    on_engine_update: Callable[[int, State], None] | None = None
    """Called in the engine's process after each applied update (local engines only)."""


BackendFactory = Callable[[BackendStart], Backend]


class TaskCursor(Protocol):
    """Which task each new group plays: a cursor over a task source, passing over the tasks
    the curriculum leaves out. Its state goes into checkpoints."""

    skipped: int

    def task(self, index: int) -> Task: ...

    def next_index(self) -> int: ...

    def category(self, index: int) -> str:
        """Task ``index``'s category (function and bug kind), which the run's per-category
        rewards are counted by."""
        ...

    def record(self, index: int, rewards: Sequence[float]) -> None:
        """A finished group of task ``index`` (the curriculum learns from its rewards)."""
        ...

    def state(self) -> dict[str, Any]: ...

    def load(self, state: dict[str, Any]) -> None: ...
