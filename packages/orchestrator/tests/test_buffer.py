"""Staleness-bounded buffer: stale groups dropped at the bound, capacity applies back-pressure."""

from __future__ import annotations

import asyncio

import pytest

from tandem.orchestrator.buffer import Group, StalenessBuffer


def _g(v: int, tag: str = "") -> Group[str]:
    return Group(samples=[f"{tag}{v}"], policy_version=v)


def test_drops_exactly_beyond_the_bound() -> None:
    async def main() -> None:
        buf: StalenessBuffer[str] = StalenessBuffer(max_staleness=2, capacity=10)
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
        buf: StalenessBuffer[str] = StalenessBuffer(max_staleness=0, capacity=10)
        await buf.put(_g(0))
        await buf.put(_g(1))
        got = await buf.take(1, trainer_version=1)
        assert [g.policy_version for g in got] == [1]
        assert buf.stats.dropped_stale == 1

    asyncio.run(main())


def test_capacity_blocks_producers_until_the_trainer_takes() -> None:
    async def main() -> None:
        buf: StalenessBuffer[str] = StalenessBuffer(max_staleness=4, capacity=2)
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
        buf: StalenessBuffer[str] = StalenessBuffer(max_staleness=1, capacity=4)
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
        StalenessBuffer(max_staleness=-1, capacity=1)
    with pytest.raises(ValueError, match="capacity"):
        StalenessBuffer(max_staleness=0, capacity=0)
