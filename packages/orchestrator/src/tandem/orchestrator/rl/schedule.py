"""How rollouts and training interleave: one module per schedule, chosen by ``rl.mode``.

``async`` (`async_schedule`) runs the two production lines at once: rollout workers play
groups into a staleness-bounded buffer while the trainer steps. ``sync`` (`sync_schedule`)
alternates: play a step's groups on the current weights, train, publish, pull. ``pipelined``
(`pipelined_schedule`) plays step k+1's groups on version k while step k trains: overlap in
lock step, as reproducible as ``sync``. The loop (`loop.RLRun`) drives whichever it is
through `Schedule`; a new schedule is one new module and one entry in `SCHEDULES`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module
from typing import Any, Protocol

from tandem.orchestrator.config import RLConfig
from tandem.orchestrator.protocols import Rollouts
from tandem.orchestrator.rl.groups import GroupSource
from tandem.orchestrator.rl.publishing import Publishing
from tandem.orchestrator.rl.staleness import StalenessRule, StalenessStats
from tandem.orchestrator.wire import Group


@dataclass
class ScheduleContext:
    """What a schedule works with: the run's groups, rollouts and publishes, its staleness
    rule and figures, and the trainer's current version (the loop's)."""

    rl: RLConfig
    source: GroupSource
    rollouts: Rollouts
    publishing: Publishing
    rule: StalenessRule
    stats: StalenessStats
    version: Callable[[], int]


class Schedule(Protocol):
    """Where each step's groups come from, and what follows the step's publish."""

    def start(self) -> list[asyncio.Task[Any]]:
        """The schedule's own background tasks (rollout workers, publish retries)."""
        ...

    async def take(self, step: int) -> list[Group]:
        """Step ``step``'s informative groups (their staleness counted in the stats)."""
        ...

    async def after_step(self, published: bool, publish_failed: bool) -> None:
        """The step is trained and its version published (or its publish failed)."""
        ...

    def cursor_state(self) -> dict[str, Any]:
        """The task cursor a checkpoint keeps: a resumed run plays every group not yet
        trained on."""
        ...

    async def close(self) -> None:
        """Stop the schedule's tasks and wake whatever waits on it."""
        ...


SCHEDULES = {
    "async": "tandem.orchestrator.rl.async_schedule:AsyncSchedule",
    "sync": "tandem.orchestrator.rl.sync_schedule:SyncSchedule",
    "pipelined": "tandem.orchestrator.rl.pipelined_schedule:PipelinedSchedule",
}


def make_schedule(context: ScheduleContext) -> Schedule:
    module, _, name = SCHEDULES[context.rl.mode].partition(":")
    return getattr(import_module(module), name)(context)
