"""``pipelined``: step k+1's groups play on version k while step k trains on version k-1's.

Every engine is on version k for the whole of step k+1's groups (none swaps mid-group), so
staleness is exactly 1 (0 in the first two steps) and the run depends only on its seeds, not
on timing or on the number of engines: as reproducible as ``sync``, without the trainer
idling through every rollout.
"""

from __future__ import annotations

import asyncio
from typing import Any

from tandem.orchestrator.rl.schedule import ScheduleContext
from tandem.orchestrator.runtime.cancel import cancel_and_wait
from tandem.orchestrator.wire import Group


class PipelinedSchedule:
    def __init__(self, context: ScheduleContext) -> None:
        self.c = context
        self._next: asyncio.Task[list[Group]] | None = None  # the next step's groups
        self._next_cursor: dict[str, Any] = {}  # ... and the cursor they started from

    def start(self) -> list[asyncio.Task[Any]]:
        return []

    def _play_next(self) -> None:
        self._next_cursor = self.c.source.cursor.state()
        self._next = asyncio.create_task(self.c.source.play_step(self.c.rl.groups_per_step))

    async def take(self, step: int) -> list[Group]:
        """This step's groups (played during the last step's training); then the engines
        move to the trainer's version and start the next step's groups."""
        if self._next is None:
            self._play_next()
        assert self._next is not None
        groups = await self._next
        self._next = None
        await self.c.publishing.retry_pending()  # no group on a version that is not out
        await self.c.rollouts.sync_to(self.c.version())
        if step + 1 < self.c.rl.steps:
            self._play_next()
        self.c.stats.count_taken(self.c.version(), groups)
        return groups

    async def after_step(self, published: bool, publish_failed: bool) -> None:
        return None

    def cursor_state(self) -> dict[str, Any]:
        # the next step's groups in flight are played again after a resume
        return self._next_cursor if self._next is not None else self.c.source.cursor.state()

    async def close(self) -> None:
        if self._next is not None:
            await cancel_and_wait([self._next])
