"""``sync``: play a step's groups on the current weights, train, publish, pull; repeat.

No overlap and staleness 0: every group is trained on by the version that played it. Before
each step's groups are played, the engines move to the trainer's version (a failed publish
is retried first: no rollout on a version that is not out).
"""

from __future__ import annotations

import asyncio
from typing import Any

from tandem.orchestrator.rl.schedule import ScheduleContext
from tandem.orchestrator.wire import Group


class SyncSchedule:
    def __init__(self, context: ScheduleContext) -> None:
        self.c = context

    def start(self) -> list[asyncio.Task[Any]]:
        return []

    async def take(self, step: int) -> list[Group]:
        groups = await self.c.source.play_step(self.c.rl.groups_per_step)
        self.c.stats.count_taken(self.c.version(), groups)
        return groups

    async def after_step(self, published: bool, publish_failed: bool) -> None:
        if published or publish_failed:  # the weights changed
            await self.c.publishing.retry_pending()
            await self.c.rollouts.sync_to(self.c.version())

    def cursor_state(self) -> dict[str, Any]:
        return self.c.source.cursor.state()

    async def close(self) -> None:
        return None
