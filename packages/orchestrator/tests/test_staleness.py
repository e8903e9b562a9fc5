"""The staleness rule: its bound per schedule, when rollouts may start, and the buffer that
drops stale groups at the bound and applies back-pressure at its capacity."""

from __future__ import annotations

import asyncio

import pytest

from tandem.orchestrator.config import RLConfig
from tandem.orchestrator.rl.staleness import (
    StalenessBuffer,
    StalenessRule,
    StalenessStats,
    group_version,
)
from tandem.orchestrator.wire import Group


def _g(v: int, tag: str = "") -> Group:
    return Group(samples=[f"{tag}{v}"], policy_version=v)  # type: ignore[list-item]


def buffer(max_staleness: int, capacity: int) -> StalenessBuffer:
    rule = StalenessRule(max_staleness=max_staleness, max_ahead=1)
    return StalenessBuffer(rule, capacity, StalenessStats())


def test_the_bound_of_each_schedule() -> None:
    assert StalenessRule.for_run(RLConfig(mode="sync", max_staleness=3)) == StalenessRule(0, 1)
    assert StalenessRule.for_run(RLConfig(mode="pipelined")) == StalenessRule(1, 1)
    assert StalenessRule.for_run(RLConfig(max_staleness=2)) == StalenessRule(2, 3)
    assert StalenessRule.for_run(RLConfig(max_staleness=2, max_ahead=5)) == StalenessRule(2, 5)


def test_when_a_rollout_worker_may_start_a_group() -> None:
    rule = StalenessRule(max_staleness=1, max_ahead=2)
    # groups in flight: fewer than max_ahead steps' worth of groups
    assert rule.may_start(7, groups_per_step=4, engine_version=5, trainer_version=5)
    assert not rule.may_start(8, groups_per_step=4, engine_version=5, trainer_version=5)
    # engines at most max_staleness behind the trainer
    assert rule.min_engine_version(5) == 4
    assert rule.may_start(0, groups_per_step=4, engine_version=4, trainer_version=5)
    assert not rule.may_start(0, groups_per_step=4, engine_version=3, trainer_version=5)


def test_a_group_counts_as_its_oldest_token() -> None:
    class S:
        def __init__(self, lo: int) -> None:
            self.min_version = lo

    assert group_version([S(3), S(2), S(4)]) == 2  # type: ignore[list-item]
    rule = StalenessRule(max_staleness=1, max_ahead=1)
    assert rule.fresh(3, _g(2)) and not rule.fresh(4, _g(2))


def test_drops_exactly_beyond_the_bound() -> None:
    async def main() -> None:
        buf = buffer(max_staleness=2, capacity=10)
        for v in range(6):
            await buf.put(_g(v))
        got = await buf.take(2, trainer_version=5)
        # versions 0,1,2 are 5,4,3 behind (> 2): dropped; 3 and 4 are used, oldest first.
        assert [g.policy_version for g in got] == [3, 4]
        assert buf.stats.dropped_stale == 3
        assert buf.stats.staleness_histogram == {2: 1, 1: 1}
        assert buf.stats.dropped_fraction == pytest.approx(3 / 5)
        assert len(buf) == 1

    asyncio.run(main())


def test_sync_mode_uses_only_current_version() -> None:
    async def main() -> None:
        buf = buffer(max_staleness=0, capacity=10)
        await buf.put(_g(0))
        await buf.put(_g(1))
        got = await buf.take(1, trainer_version=1)
        assert [g.policy_version for g in got] == [1]
        assert buf.stats.dropped_stale == 1

    asyncio.run(main())


def test_capacity_blocks_producers_until_the_trainer_takes() -> None:
    async def main() -> None:
        buf = buffer(max_staleness=4, capacity=2)
        await buf.put(_g(0, "a"))
        await buf.put(_g(0, "b"))
        blocked = asyncio.create_task(buf.put(_g(0, "c")))
        await asyncio.sleep(0.01)
        assert not blocked.done() and len(buf) == 2
        got = await buf.take(1, trainer_version=0)
        assert got[0].samples == ["a0"]
        await asyncio.wait_for(blocked, 1.0)
        assert len(buf) == 2

    asyncio.run(main())


def test_take_waits_for_producers_and_close_wakes_everyone() -> None:
    async def main() -> None:
        buf = buffer(max_staleness=1, capacity=4)
        taker = asyncio.create_task(buf.take(2, trainer_version=3))
        await buf.put(_g(3))
        await asyncio.sleep(0.01)
        assert not taker.done()
        await buf.put(_g(2))
        got = await asyncio.wait_for(taker, 1.0)
        assert [g.policy_version for g in got] == [3, 2]
        waiting = asyncio.create_task(buf.take(1, trainer_version=3))
        await asyncio.sleep(0.01)
        await buf.close()
        with pytest.raises(RuntimeError, match="closed"):
            await asyncio.wait_for(waiting, 1.0)
        with pytest.raises(RuntimeError, match="closed"):
            await buf.put(_g(3))

    asyncio.run(main())


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="max_staleness"):
        buffer(max_staleness=-1, capacity=1)
    with pytest.raises(ValueError, match="capacity"):
        buffer(max_staleness=0, capacity=0)
