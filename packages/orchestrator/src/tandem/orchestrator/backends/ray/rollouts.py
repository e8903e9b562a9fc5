"""The ``ray`` backend: rollout engines as Ray actors, anywhere that can reach the store.

Each `RolloutWorker` actor (`worker`) is one engine with its own weight subscriber. Nothing
but group indices and finished groups crosses between the driver and the actors; weights
only flow through the store (or a region's relay, ``ray.pull_from``).

Played groups come back as `tandem.orchestrator.wire` messages (msgpack bytes).

The driver (`RayRollouts`, the backend's `Rollouts`) leaves the staleness rule to the RL
loop. It hands each group to the least-loaded live actor; when an actor dies, its groups in flight fail
with `WorkerLost` and are played again by another actor from the start, so no partial
trajectory reaches the trainer, and a replacement actor is started. Workers may be added
and removed (drained or killed) while the run goes on, directly or through the run's
`PoolControl` actor (``tandem workers``); the pool size is kept over time for the metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import structlog

from tandem.orchestrator.backends.ray.cluster import connect
from tandem.orchestrator.backends.ray.envs import RAY_NAMESPACE, EnvPool, env_pool_name
from tandem.orchestrator.backends.ray.worker import RolloutWorker, WorkerSpec
from tandem.orchestrator.config import RayConfig
from tandem.orchestrator.protocols import EngineStopped, WorkerLost
from tandem.orchestrator.runtime.cancel import cancel_and_wait
from tandem.orchestrator.wire import PlayedGroup, RolloutStats, decode

log = structlog.get_logger()


def pool_name(run_name: str) -> str:
    """The name of a run's `PoolControl` actor (in the ``tandem`` namespace)."""
    return f"pool-{run_name}"


class PoolControl:
    """A named actor holding how many rollout workers the run should have (``tandem
    workers add/remove`` changes it; the driver follows) and what the driver last reported:
    workers running, and workers asked for that have not started yet (pending: waiting for
    the cluster to place them, or building their engine)."""

    def __init__(self, target: int, worker_resources: dict[str, float] | None = None) -> None:
        self.target = target
        self.worker_resources = worker_resources or {}
        self.running = self.pending = 0

    def resize(self, delta: int) -> int:
        self.target = max(1, self.target + delta)
        return self.target

    def get(self) -> int:
        return self.target

    def report(self, running: int, pending: int) -> None:
        self.running, self.pending = running, pending

    def status(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "running": self.running,
            "pending": self.pending,
            "worker_resources": self.worker_resources,
        }


@dataclass
class _Worker:
    name: str
    handle: Any
    version: int = -1
    inflight: int = 0
    draining: bool = False


@dataclass
class RayRollouts:
    """The driver's view of the rollout actors (same interface as `LocalRollouts`)."""

    spec: WorkerSpec
    config: RayConfig
    run_name: str = "tandem"
    stream: int = 0
    workers: list[_Worker] = field(default_factory=list)
    pool_sizes: list[tuple[float, int]] = field(default_factory=list)
    lost: int = 0
    _started_ray: bool = False
    _names: Any = field(default_factory=lambda: itertools.count())
    _stats: dict[str, RolloutStats] = field(default_factory=dict)
    _pending: dict[str, Any] = field(default_factory=dict)  # actors asked for, not started
    _droppable: set[str] = field(default_factory=set)  # of those, the ones for the target
    _changes: set[asyncio.Task[Any]] = field(default_factory=set)
    _watcher: asyncio.Task[Any] | None = None  # `_watch`, from `start` until `close`
    assigned: dict[str, int] = field(default_factory=dict)  # groups handed to each worker
    env_pools: list[Any] = field(default_factory=list)  # environment-pool actor handles
    _t0: float = field(default_factory=time.monotonic)
    _follow: bool = True  # actors pull each new version by themselves (async mode)
    _pinned: int | None = None  # the version `sync_to` put the pool on (modes that call it
    # do not follow; None: a new actor starts on the newest version)
    control: Any = None  # the run's `PoolControl` actor
    _requested: list[tuple[str, Any]] = field(default_factory=list)  # asked for, not started

    def request_actors(self) -> None:
        """Ask the cluster for the pool's control actor, the environment pools and the first
        ``workers`` rollout actors without waiting for any of them. Their processes start and
        import their code while the caller goes on (the backend starts the trainer ranks
        meanwhile); `start` then waits for them. Once per run; `start` calls it if nobody did."""
        if self.control is not None:
            return
        import ray

        self._cls = ray.remote(RolloutWorker)
        self.control = (
            ray.remote(PoolControl)
            .options(
                name=pool_name(self.run_name),
                namespace=RAY_NAMESPACE,
                get_if_exists=True,
                num_cpus=0,
            )
            .remote(self.config.workers, self.worker_resources)
        )
        cls = ray.remote(EnvPool)
        names = [env_pool_name(self.run_name, self.stream, i) for i in range(self.config.env_pools)]
        self.env_pools = [
            cls.options(name=n, namespace=RAY_NAMESPACE, num_cpus=self.config.env_cpus).remote(n)
            for n in names
        ]
        self.spec = msgspec.structs.replace(self.spec, env_pools=names)
        self._requested = [self._new_actor() for _ in range(self.config.workers)]

    def drop_requested(self) -> None:
        """Kill the rollout actors asked for and never started (a run that failed before
        `start`), so their names are free for the next run."""
        import ray

        for _, handle in self._requested:
            with contextlib.suppress(Exception):
                ray.kill(handle, no_restart=True)
        self._requested.clear()

    def _new_actor(self) -> tuple[str, Any]:
        """A rollout actor asked of the cluster (its process starts; nothing waits for it)."""
        name = f"rollout-{next(self._names)}"
        handle = self._cls.options(
            num_cpus=self.config.worker_cpus,
            num_gpus=self.config.worker_gpus,
            max_concurrency=1024,
            name=f"{self.run_name}-{self.stream}-{name}",
            namespace=RAY_NAMESPACE,
        ).remote(self.spec, name, self.config.torch_threads, self.config.poll_s)
        return name, handle

    async def start(self, *, follow: bool) -> list[asyncio.Task[Any]]:
        self._follow = follow
        self._started_ray = await asyncio.to_thread(connect, self.config)
        self.request_actors()
        await self.control.resize.remote(self.config.workers - await self.control.get.remote())
        await self.env_pool_stats()  # each pool answers once it is up
        await self._first_workers(self.config.workers)
        self._watcher = asyncio.create_task(self._watch())
        return [self._watcher]

    async def _first_workers(self, count: int) -> None:
        """Start ``count`` workers and return once one plays: on a joined cluster short of
        resources the others stay pending (see ``tandem workers show``) until it grows."""
        starting = {asyncio.create_task(self.add_worker(for_target=True)) for _ in range(count)}
        while not self.workers:
            done, starting = await asyncio.wait(starting, return_when=asyncio.FIRST_COMPLETED)
            failed = [t.exception() for t in done if t.exception() is not None]
            if not starting and not self.workers:
                raise failed[0] if failed else RuntimeError("no rollout worker started")
        self._changes.update(asyncio.create_task(self._logged(lambda t=t: t)) for t in starting)

    async def env_pool_stats(self) -> list[dict[str, Any]]:
        """Per pool: its pid, episodes open now and episodes served so far."""
        return list(await asyncio.gather(*(h.stats.remote() for h in self.env_pools)))

    @property
    def worker_resources(self) -> dict[str, float]:
        """What each rollout actor declares (Ray resource names)."""
        return {"CPU": self.config.worker_cpus, "GPU": self.config.worker_gpus}

    @property
    def live(self) -> list[_Worker]:
        return [w for w in self.workers if not w.draining]

    @property
    def version(self) -> int:
        return min((w.version for w in self.live), default=-1)

    def _record_size(self) -> None:
        self.pool_sizes.append((time.monotonic() - self._t0, len(self.workers)))

    async def resize(self, delta: int) -> int:
        """Ask for ``delta`` more (or fewer) workers; the pool follows within a second.
        Leaving workers are drained: they finish their groups and get no new ones."""
        return int(await self.control.resize.remote(delta))

    async def add_worker(self, *, for_target: bool = False) -> str:
        """Start one more actor; it takes groups once it holds the newest version. One the
        pool starts to reach `PoolControl`'s target (``for_target``) is dropped while still
        pending when the target is lowered."""
        name, handle = self._requested.pop(0) if self._requested else self._new_actor()
        self._pending[name] = handle
        if for_target:
            self._droppable.add(name)
        try:
            # a worker joining a pool that does not follow starts on the pool's version, so a
            # replaced worker replays its groups on the weights they were meant for
            version = await handle.start.remote(self._follow, self._pinned)
        except asyncio.CancelledError:  # the pool is closing: the actor must not outlive it
            import ray

            with contextlib.suppress(Exception):
                ray.kill(handle, no_restart=True)
            raise
        except Exception:
            if name not in self._pending:  # cancelled (`_cancel_pending`)
                return name
            raise
        finally:
            self._pending.pop(name, None)
            self._droppable.discard(name)
        self.workers.append(_Worker(name, handle, version=version))
        self._record_size()
        log.info("ray.worker_added", worker=name, version=version, pool=len(self.workers))
        return name

    async def remove_worker(self, name: str | None = None, *, kill: bool = False) -> str:
        """Take a worker out now: drained (finishes its groups, gets no new one) or killed
        (its groups in flight fail with `WorkerLost` and are re-queued by the caller)."""
        import ray

        live = self.live
        w = next((x for x in live if x.name == name), None) if name else (live or [None])[-1]
        if w is None:
            raise ValueError(f"no live rollout worker named {name!r}" if name else "no worker")
        w.draining = True
        if not kill:
            while w.inflight:
                await asyncio.sleep(0.05)
            with contextlib.suppress(Exception):
                await w.handle.stop.remote()
        ray.kill(w.handle, no_restart=True)
        self._forget(w)
        log.info("ray.worker_removed", worker=w.name, killed=kill, pool=len(self.workers))
        return w.name

    def _forget(self, w: _Worker) -> None:
        if w in self.workers:
            self.workers.remove(w)
            self._record_size()

    def _lost(self, w: _Worker, error: BaseException) -> None:
        """Count ``w`` lost (dead, hung or no longer serving) and make sure it is gone."""
        import ray

        if w not in self.workers:
            return  # removed on purpose, or already counted
        self._forget(w)
        self.lost += 1
        if ray.is_initialized():
            with contextlib.suppress(Exception):
                ray.kill(w.handle, no_restart=True)
        log.warning("ray.worker_lost", worker=w.name, error=str(error)[:200])

    async def _watch(self) -> None:
        """Keep the pool at `PoolControl`'s target: replace lost actors (``replace_lost``),
        start or drain workers when the target changes."""
        while True:
            await asyncio.sleep(0.5)
            try:
                target = int(await self.control.get.remote())
            except Exception as e:
                log.warning("ray.pool_control_unreachable", error=str(e)[:200])
                continue
            have = len(self.live) + len(self._pending)
            if have < target and (self.config.replace_lost or not self.lost):
                work = functools.partial(self.add_worker, for_target=True)
                self._changes.add(asyncio.create_task(self._logged(work)))
            elif have > target and self._droppable:
                self._cancel_pending(self._droppable.pop())
            elif have > target and len(self.live) > 1:
                self._changes.add(asyncio.create_task(self._logged(self.remove_worker)))
            self._changes = {t for t in self._changes if not t.done()}
            with contextlib.suppress(Exception):
                await self.control.report.remote(len(self.live), len(self._pending))

    def _cancel_pending(self, name: str) -> None:
        """Shrink the pool by an actor that has not started (it may never have been placed),
        rather than by a worker that is playing."""
        import ray

        handle = self._pending.pop(name)
        ray.kill(handle, no_restart=True)  # its `start` fails; `add_worker` drops it
        log.info("ray.worker_cancelled", worker=name, pool=len(self.workers))

    @staticmethod
    async def _logged(work: Callable[[], Awaitable[Any]]) -> None:
        """Run one pool change, logging its failure. Its coroutine is made in the task: one
        cancelled before it starts (at close) leaves no coroutine never awaited."""
        try:
            await work()
        except Exception as e:  # the watcher tries again on its next round
            log.warning("ray.pool_change_failed", error=str(e)[:300])

    async def play(self, index: int, min_version: int = -1) -> PlayedGroup:
        from ray.exceptions import RayActorError

        while not self.live:
            await asyncio.sleep(0.05)
        # the least busy worker; among equals, the one given the fewest groups so far (a
        # worker that just joined gets the next group)
        w = min(self.live, key=lambda x: (x.inflight, self.assigned.get(x.name, 0), x.name))
        w.inflight += 1
        self.assigned[w.name] = self.assigned.get(w.name, 0) + 1
        # every episode of a group is cut at its budget inside the actor: one that has not
        # answered well past it is hung (its engine or event loop stuck), not slow
        env = self.spec.env
        deadline = env.episode_wall_s + env.grade_timeout_s + self.config.stall_s
        try:
            played = decode(
                await asyncio.wait_for(w.handle.play.remote(index, min_version), timeout=deadline),
                PlayedGroup,
            )
        except (RayActorError, EngineStopped, TimeoutError) as e:
            if isinstance(e, TimeoutError):
                why = f"did not answer within {deadline:g} s"
            else:
                why = "died" if isinstance(e, RayActorError) else "stopped serving"
            self._lost(w, RuntimeError(f"{why}: {e}"))
            raise WorkerLost(f"{w.name} {why} playing group {index}") from None
        finally:
            w.inflight -= 1
        if played.samples:
            w.version = max(w.version, max(s.max_version for s in played.samples))
        return played

    def published(self) -> None:
        for w in self.live:
            w.handle.published.remote()

    async def sync_to(self, version: int) -> None:
        """Every live actor on ``version`` (they pull at once)."""
        self._pinned = version
        live = list(self.live)
        got = await asyncio.gather(
            *(w.handle.sync_to.remote(version) for w in live), return_exceptions=True
        )
        for w, v in zip(live, got, strict=True):
            if isinstance(v, BaseException):  # a lost actor is replaced on `_pinned`
                self._lost(w, v)
            else:
                w.version = v

    async def stats(self) -> RolloutStats:
        """Counters over every actor the run had (a gone actor's last figures are kept, so
        they never go backwards); the version is the laggard's among live ones."""
        for w in list(self.live):
            with contextlib.suppress(Exception):
                s: RolloutStats = await w.handle.stats.remote()
                self._stats[w.name] = s
                w.version = s.engine_version
        merged = RolloutStats.merge(list(self._stats.values()))
        merged.engine_version = self.version
        merged.workers = len(self.workers)
        return merged

    async def close(self) -> None:
        import ray

        # the watcher first: it would otherwise start actors to refill the pool being closed
        await cancel_and_wait([*filter(None, [self._watcher]), *self._changes])
        self._changes.clear()
        while self._pending:
            self._cancel_pending(next(iter(self._pending)))
        self.drop_requested()
        # rollout actors first: their episodes' sandboxes may live in the pools
        for handle in [*(w.handle for w in self.workers), *self.env_pools]:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(handle.stop.remote(), timeout=10)
            with contextlib.suppress(Exception):
                ray.kill(handle, no_restart=True)
        if self.control is not None:
            with contextlib.suppress(Exception):
                ray.kill(self.control, no_restart=True)
        self.workers.clear()
        if self._started_ray:
            ray.shutdown()
