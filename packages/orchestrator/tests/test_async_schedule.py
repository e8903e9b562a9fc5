"""The ``async`` schedule plays no more groups than the run's remaining steps can train (and
one step's worth to replace groups without signal), and none while its last step trains."""

from __future__ import annotations

import asyncio
from typing import Any

from tandem.orchestrator.config import RLConfig
from tandem.orchestrator.rl.async_schedule import AsyncSchedule
from tandem.orchestrator.rl.schedule import ScheduleContext
from tandem.orchestrator.rl.staleness import StalenessRule, StalenessStats
from tandem.orchestrator.wire import Group


class _Source:
    """Groups played at once from a counter; every ``silent``-th one has no signal."""

    def __init__(self, silent: int = 0) -> None:
        self.cursor, self.signal = self, self
        self.played = 0
        self.silent = silent

    def next_index(self) -> int:
        return self.played

    def record(self, index: int, rewards: list[float]) -> None:
        pass

    async def play(self, index: int, min_version: int) -> Group:
        self.played += 1
        await asyncio.sleep(0.001)
        return Group(samples=[], policy_version=index)  # the index stands in for rewards

    def informative(self, group: Group) -> bool:
        return not self.silent or (group.policy_version + 1) % self.silent != 0


class _Publishing:
    async def retry_failed(self) -> None:
        await asyncio.Event().wait()


class _Rollouts:
    version = 0


async def _run(rl: RLConfig, source: _Source) -> list[int]:
    """Take every step's groups with a short training pause between; then wait a while as a
    last checkpoint would. Returns the groups played after each take."""
    version = [0]
    schedule = AsyncSchedule(
        ScheduleContext(
            rl=rl,
            source=source,  # type: ignore[arg-type]
            rollouts=_Rollouts(),  # type: ignore[arg-type]
            publishing=_Publishing(),  # type: ignore[arg-type]
            rule=StalenessRule(max_staleness=rl.steps, max_ahead=3),
            stats=StalenessStats(),
            version=lambda: version[0],
        )
    )
    tasks: list[asyncio.Task[Any]] = schedule.start()
    played = []
    try:
        for step in range(rl.steps):
            groups = await schedule.take(step)
            assert len(groups) == rl.groups_per_step
            await asyncio.sleep(0.2)  # training: the workers have time to play ahead
            version[0] += 1
            played.append(source.played)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await schedule.close()
    return played


def test_no_group_is_played_that_the_run_cannot_train() -> None:
    rl = RLConfig(steps=3, groups_per_step=2, group_size=2, rollout_workers=8)
    played = asyncio.run(_run(rl, _Source()))
    # three steps' worth in flight at first (max_ahead), then as many as the steps left, one
    # step's worth more while a step is left; none once the last step's groups are taken
    assert played[-1] <= 3 * 2 + 2, played
    assert played[-1] > 3 * 2  # the margin was played: the workers ran ahead
    # without the bound they would have filled max_ahead again: 3 x 2 more after the last take
    assert played[-1] < 3 * 2 + 3 * 2


def test_groups_without_signal_are_replaced_to_the_end() -> None:
    rl = RLConfig(steps=3, groups_per_step=2, group_size=2, rollout_workers=8)
    source = _Source(silent=3)  # a third of the groups teach nothing
    played = asyncio.run(_run(rl, source))
    assert len(played) == 3  # every step got its informative groups
    assert played[-1] <= 9 + 2, played  # 6 informative of the first 9, and the margin
