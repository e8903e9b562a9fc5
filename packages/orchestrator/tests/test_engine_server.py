"""The engine server's weight pulls and failure paths, and how the Ray driver treats a
rollout actor that stops serving or hangs."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import torch

from tandem.agent_env import EnvConfig
from tandem.delta_sync import LocalStore
from tandem.orchestrator.backends.ray.rollouts import RayRollouts, _Worker
from tandem.orchestrator.backends.ray.worker import WorkerSpec
from tandem.orchestrator.config import EngineConfig, EpisodeConfig, RayConfig, TaskConfig
from tandem.orchestrator.inference.embedded.engine import InferenceEngine
from tandem.orchestrator.inference.embedded.server import EngineServer
from tandem.orchestrator.policy import clone_model
from tandem.orchestrator.protocols import EngineStopped, WorkerLost
from tandem.orchestrator.training.weights import WeightPublisher, state_for_sync, weights_equal


class _CountingSubscriber:
    """A real subscriber whose prepare is slowed and counted (to see pulls overlap)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.active = 0
        self.most_at_once = 0
        self.chain: list[tuple[int | None, int]] = []
        self._lock = threading.Lock()

    def prepare(self, version: int | None = None) -> Any:
        with self._lock:
            self.active += 1
            self.most_at_once = max(self.most_at_once, self.active)
        try:
            time.sleep(0.05)
            prepared = self.inner.prepare(version)
            self.chain.append((prepared.from_version, prepared.version))
            return prepared
        finally:
            with self._lock:
                self.active -= 1


def test_overlapping_pulls_prepare_one_after_another(chat, tiny_policy, tmp_path) -> None:
    """A periodic pull and a requested one may run together: each must prepare from the
    version the other applied, never both from the same base (the second then could not be
    applied and would stop the engine)."""
    engine = InferenceEngine(clone_model(tiny_policy), EngineConfig(), stop_id=chat.end_id)
    publisher = WeightPublisher(LocalStore(str(tmp_path)), tiny_policy, anchor_every=10)
    publisher.publish(0)
    sub = _CountingSubscriber(publisher.subscriber(0))
    engine.version = 0

    async def run() -> None:
        server = EngineServer(engine)
        serving = asyncio.create_task(server.serve())
        for version in (1, 2, 3):
            with torch.no_grad():
                for p in tiny_policy.parameters():
                    p.add_(torch.randn_like(p) * 1e-2)
            publisher.publish(version)
            await asyncio.gather(server.pull(sub), server.pull(sub), server.pull(sub))
            while engine.version < version:
                server.check_serving()
                await asyncio.sleep(0.005)
        assert not serving.done()
        server.close()
        await serving

    asyncio.run(run())
    assert sub.most_at_once == 1
    applied = [(f, v) for f, v in sub.chain if v != f]
    assert applied == [(0, 1), (1, 2), (2, 3)]
    assert engine.version == 3 and engine.stats.updates == 3
    assert weights_equal(engine.state, state_for_sync(tiny_policy))


class _Unappliable:
    version = 7

    def apply(self, state: Any) -> Any:
        raise RuntimeError("corrupt staged version")


def test_a_turn_asked_of_a_stopped_engine_fails_at_once(chat, tiny_policy) -> None:
    engine = InferenceEngine(clone_model(tiny_policy), EngineConfig(), stop_id=chat.end_id)

    async def run() -> None:
        server = EngineServer(engine)
        serving = asyncio.create_task(server.serve())
        engine.stage_update(_Unappliable())
        server.wake()
        with pytest.raises(RuntimeError, match="corrupt staged version"):
            await serving
        slot = await server.acquire()
        with pytest.raises(EngineStopped, match="corrupt staged version"):
            await asyncio.wait_for(
                server.generate(slot, [chat.end_id], torch.Generator(), 4), timeout=5
            )

    asyncio.run(run())


class _Remote:
    def __init__(self, call: Any) -> None:
        self.call = call

    def remote(self, *args: Any) -> Any:
        return self.call(*args)


class _FakeActor:
    """Stands in for an actor handle: ``play.remote`` runs ``behaviour``."""

    def __init__(self, behaviour: Any) -> None:
        self.play = _Remote(behaviour)


def _driver(stall_s: float) -> RayRollouts:
    spec = WorkerSpec(
        model=None,  # type: ignore[arg-type]
        engine=EngineConfig(),
        env=EnvConfig(episode_wall_s=0.2, grade_timeout_s=0.1),
        episode=EpisodeConfig(),
        tasks=TaskConfig(),
        task_seed=0,
        task_offset=0,
        seed=0,
        group_size=2,
        store_url="",
    )
    return RayRollouts(spec, RayConfig(stall_s=stall_s))


@pytest.mark.parametrize("failure", ["hangs", "stopped"])
def test_an_actor_that_hangs_or_stops_serving_is_lost_and_its_group_requeued(failure) -> None:
    async def hang(index: int, min_version: int) -> Any:
        await asyncio.sleep(3600)

    async def stopped(index: int, min_version: int) -> Any:
        raise EngineStopped("inference engine stopped: boom")

    driver = _driver(stall_s=0.2)
    bad = _Worker("rollout-0", _FakeActor(hang if failure == "hangs" else stopped))
    driver.workers.append(bad)

    async def run() -> float:
        t0 = time.monotonic()
        with pytest.raises(WorkerLost, match="rollout-0") as info:
            await driver.play(5, 0)
        assert "group 5" in str(info.value)
        return time.monotonic() - t0

    took = asyncio.run(run())
    assert driver.lost == 1 and driver.workers == [] and bad.inflight == 0
    if failure == "hangs":
        # the episode budget (0.3 s) plus the stall allowance (0.2 s), not an hour
        assert 0.45 <= took < 5
