"""Closing the Ray rollout pool stops its watcher and the pool changes in flight first, so
nothing refills the pool being closed and no change is left for the event loop's teardown
(where a change cancelled before it started left a coroutine never awaited, printed after
`tandem train`'s last line on Ctrl-C). Stand-ins for the control actor and the actor start:
no cluster is needed."""

from __future__ import annotations

import asyncio
import gc
import warnings
from typing import Any

import pytest

from tandem.orchestrator.backends.ray.rollouts import RayRollouts
from tandem.orchestrator.config import RayConfig

ray = pytest.importorskip("ray")


class _Method:
    """``actor.method.remote(...)``: an awaitable of the method's result."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        async def call() -> Any:
            return self.fn(*args)

        return call()


class _Control:
    """A `PoolControl` whose target is always above the pool's size."""

    get = _Method(lambda: 3)
    report = _Method(lambda running, pending: None)


def test_closing_stops_the_watcher_and_the_changes_in_flight_first(monkeypatch) -> None:
    killed: list[Any] = []  # Ray's kill would start a local Ray instance for the stand-ins
    monkeypatch.setattr(ray, "kill", lambda handle, **_: killed.append(handle))
    rollouts = RayRollouts(spec=None, config=RayConfig(workers=1, poll_s=0.5))  # type: ignore[arg-type]
    rollouts.control = _Control()
    starting: list[asyncio.Task[Any]] = []

    async def add_worker(*, for_target: bool = False) -> str:  # an actor that takes long
        starting.append(asyncio.current_task())  # type: ignore[arg-type]
        await asyncio.sleep(3600)
        return "never"

    rollouts.add_worker = add_worker  # type: ignore[method-assign]

    async def run_then_close() -> list[asyncio.Task[Any]]:
        rollouts._watcher = asyncio.create_task(rollouts._watch())

        async def changes_started() -> None:  # the watcher has started changes to reach its target
            while len(starting) < 2:
                await asyncio.sleep(0.05)

        try:
            await asyncio.wait_for(changes_started(), timeout=30)
        except TimeoutError:
            pytest.fail(f"the watcher started {len(starting)} of 2 pool changes within 30 s")
        await rollouts.close()
        others = asyncio.all_tasks() - {asyncio.current_task()}
        return [t for t in others if not t.done()]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        left = asyncio.run(run_then_close())
        gc.collect()
    assert left == []  # nothing of the pool runs on after close
    assert rollouts._watcher is not None and rollouts._watcher.cancelled()
    assert starting and all(t.cancelled() for t in starting)
    assert not rollouts._changes
    assert killed == [rollouts.control] and not ray.is_initialized()
    assert not [w for w in caught if "never awaited" in str(w.message)]
