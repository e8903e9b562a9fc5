"""``async``: the two production lines at once.

``rl.rollout_workers`` workers play groups and put them in the staleness buffer while the
trainer takes groups as they complete, steps, and publishes; the engines pull each new
version and apply it between decoding steps. Workers start a group only while the staleness
rule allows (`StalenessRule.may_start`); a group lost with its worker is played again from
the start by another. Groups without signal are skipped and the trainer waits for more, so
every step learns from ``groups_per_step`` informative groups. Near the end of the run
workers start no more groups than its remaining steps can train, plus one step's worth for
groups without signal, and none while the last step trains: what would only be dropped at
the end is not played, and the cores stay with the trainer (`SpareCores`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from tandem.orchestrator.protocols import WorkerLost
from tandem.orchestrator.rl.schedule import ScheduleContext
from tandem.orchestrator.rl.staleness import StalenessBuffer
from tandem.orchestrator.wire import Group


class AsyncSchedule:
    def __init__(self, context: ScheduleContext) -> None:
        self.c = context
        self.buffer = StalenessBuffer(context.rule, context.rl.buffer_capacity, context.stats)
        self.started = 0  # groups started and not given up (trained, dropped or queued)
        self._requeued: list[int] = []  # groups lost with their rollout worker
        self._steps_left = context.rl.steps  # steps whose groups are not all taken yet
        self._have = 0  # informative groups the current take has

    def _wanted(self) -> int:
        """Groups worth having in flight or queued: the rest of the run's, and one step's
        more while a step is left to take them (groups without signal need replacing)."""
        left = self._steps_left + (self._steps_left > 0)
        return left * self.c.rl.groups_per_step - self._have

    def start(self) -> list[asyncio.Task[Any]]:
        tasks = [asyncio.create_task(self.c.publishing.retry_failed())]
        tasks += [asyncio.create_task(self._worker()) for _ in range(self.c.rl.rollout_workers)]
        return tasks

    def _in_flight(self) -> int:
        stats = self.c.stats
        return self.started - stats.taken - stats.dropped_stale

    async def _worker(self) -> None:
        c = self.c
        while True:
            while self._in_flight() >= self._wanted() or not c.rule.may_start(
                self._in_flight(), c.rl.groups_per_step, c.rollouts.version, c.version()
            ):
                await asyncio.sleep(0.01)
            self.started += 1
            index = self._requeued.pop(0) if self._requeued else c.source.cursor.next_index()
            try:
                group = await c.source.play(index, c.rule.min_engine_version(c.version()))
            except WorkerLost as e:
                c.source.lost(index, e)
                self._requeued.append(index)
                self.started -= 1
                continue
            if group is None:
                self.started -= 1
                continue
            c.source.cursor.record(index, [s.reward for s in group.samples])
            await self.buffer.put(group)

    async def take(self, step: int) -> list[Group]:
        self._steps_left, self._have = self.c.rl.steps - step, 0
        groups: list[Group] = []
        while len(groups) < self.c.rl.groups_per_step:
            for g in await self.buffer.take(1, self.c.version()):
                if self.c.source.signal.informative(g):
                    groups.append(g)
                    self._have += 1
        self._steps_left, self._have = self.c.rl.steps - step - 1, 0
        return groups

    async def after_step(self, published: bool, publish_failed: bool) -> None:
        if published:
            self.c.rollouts.published()
        if publish_failed:
            self.c.publishing.failed.set()

    def cursor_state(self) -> dict[str, Any]:
        return self.c.source.cursor.state()

    async def close(self) -> None:
        await self.buffer.close()
