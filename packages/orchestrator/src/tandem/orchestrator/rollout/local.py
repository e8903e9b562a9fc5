"""Rollouts: groups of episodes played by one engine that follows the weight stream.

`LocalRollouts` is the whole inference side of one engine: the engine, its asyncio server,
the subscriber it pulls new policy versions with, and `play` for one GRPO group. The RL loop
drives one in its own process (the ``local`` backend); on the ``ray`` backend every rollout
actor holds one (`tandem.orchestrator.ray_backend`). Either way a group depends only on
(task, seed, group index) and the weights it was played with: the engine is batch-invariant,
so where a group runs and what shares its batches does not change its samples.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from tandem.agent_env import Env, EnvConfig, SandboxError, Task
from tandem.delta_sync import StoreError, Subscriber
from tandem.orchestrator.cancel import cancel_and_wait
from tandem.orchestrator.chat_format import ChatFormat
from tandem.orchestrator.config import EngineConfig, EnvSettings
from tandem.orchestrator.engine import InferenceEngine
from tandem.orchestrator.episode import Sample, episode_generator, run_episode
from tandem.orchestrator.server import EngineServer
from tandem.orchestrator.tasks import env_config

log = structlog.get_logger()

RETRY_S, RETRY_MAX_S = 0.5, 5.0  # backoff while the weight store fails


class WorkerLost(RuntimeError):
    """A rollout worker died with groups in flight; they are played again elsewhere."""


@dataclass
class PlayedGroup:
    """The outcome of one group: its samples, or why it was dropped (``dropped`` non-empty:
    episodes cut past their budget, or a sandbox that failed to start)."""

    index: int
    samples: list[Sample] = field(default_factory=list)
    dropped: str = ""
    cut: int = 0


@dataclass
class RolloutStats:
    """Inference-side figures for the step metrics (summed or merged over engines)."""

    tokens_sampled: int = 0
    tokens_fed: int = 0
    tokens_reused: int = 0
    engine_version: int = -1
    pause_s: list[float] = field(default_factory=list)
    prepare_s: list[float] = field(default_factory=list)
    sync_bytes: int = 0
    pull_failures: int = 0
    workers: int = 1
    busy_s: float = 0.0  # seconds in engine steps (prefill, decode, swaps), summed over engines

    @staticmethod
    def merge(parts: list[RolloutStats]) -> RolloutStats:
        """Several engines as one: counters add up, the version is the laggard's."""
        out = RolloutStats(workers=len(parts))
        for p in parts:
            out.tokens_sampled += p.tokens_sampled
            out.tokens_fed += p.tokens_fed
            out.tokens_reused += p.tokens_reused
            out.pause_s += p.pause_s
            out.prepare_s += p.prepare_s
            out.sync_bytes += p.sync_bytes
            out.pull_failures += p.pull_failures
            out.busy_s += p.busy_s
        out.engine_version = min((p.engine_version for p in parts), default=-1)
        return out


async def play_group(
    server: EngineServer,
    chat: ChatFormat,
    task: Task,
    *,
    env: EnvSettings,
    max_new_tokens: int,
    seed: int,
    index: int,
    group_size: int,
    open_env: Callable[[Task, EnvConfig], Any] = Env,
) -> PlayedGroup:
    """Play ``group_size`` episodes of ``task`` at once (episode j seeded by (seed, index, j)).

    An episode still running past its wall budget plus grading has overrun every limit it
    has (a stalled sandbox or engine): it is cut and its group dropped, never half-kept.
    """
    budget = env.episode_wall_s + env.grade_timeout_s
    config = env_config(env)
    results = await asyncio.gather(
        *(
            asyncio.wait_for(
                run_episode(
                    server,
                    chat,
                    task,
                    config,
                    max_new_tokens=max_new_tokens,
                    max_observation_chars=env.max_observation_chars,
                    generator=episode_generator(seed, index, j),
                    open_env=open_env,
                ),
                timeout=budget,
            )
            for j in range(group_size)
        ),
        return_exceptions=True,
    )
    cut = sum(isinstance(r, TimeoutError) for r in results)
    if cut:
        return PlayedGroup(index, dropped=f"{cut} episodes past {budget:g} s", cut=cut)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        if not all(isinstance(e, SandboxError) for e in errors):
            raise next(e for e in errors if not isinstance(e, SandboxError))
        return PlayedGroup(index, dropped=f"sandbox: {errors[0]}")
    return PlayedGroup(index, samples=[r for r in results if isinstance(r, Sample)])


class LocalRollouts:
    """One engine, its server and its weight subscriber; plays groups on request.

    ``poll_s``: also look for a new version this often without being told (an engine that
    may miss a notification, e.g. one that joined late or runs far from the trainer).
    ``open_env``: makes each episode's environment (default: a sandbox in this process).
    """

    def __init__(
        self,
        engine: InferenceEngine,
        subscriber: Subscriber,
        tasks: Any,
        *,
        env: EnvSettings,
        engine_cfg: EngineConfig,
        seed: int,
        group_size: int,
        poll_s: float | None = None,
        open_env: Callable[[Task, EnvConfig], Any] = Env,
    ) -> None:
        self.engine = engine
        self.open_env = open_env
        self.server = EngineServer(engine)
        self.subscriber = subscriber
        self.tasks = tasks
        self.env, self.engine_cfg = env, engine_cfg
        self.seed, self.group_size = seed, group_size
        self.poll_s = poll_s
        self.chat = ChatFormat()
        self.pull_failures = 0
        self._published = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []

    @property
    def version(self) -> int:
        return self.engine.version

    async def start(self, *, follow: bool) -> list[asyncio.Task[Any]]:
        """Start serving (and following the weight stream); returns the background tasks."""
        self._tasks = [asyncio.create_task(self.server.serve())]
        if follow:
            self._tasks.append(asyncio.create_task(self._follow()))
        return list(self._tasks)

    async def play(self, index: int, min_version: int = -1) -> PlayedGroup:
        """Group ``index`` once the engine holds at least ``min_version`` (a group started on
        older weights could only be dropped as stale)."""
        while self.engine.version < min_version:
            self.server.check_serving()
            await asyncio.sleep(0.01)
        return await play_group(
            self.server,
            self.chat,
            self.tasks[index],
            env=self.env,
            max_new_tokens=self.engine_cfg.max_new_tokens,
            seed=self.seed,
            index=index,
            group_size=self.group_size,
            open_env=self.open_env,
        )

    def published(self) -> None:
        """A newer version is in the store: pull it (in the background)."""
        self._published.set()

    async def sync_to(self, version: int) -> None:
        """Pull until the engine holds ``version`` (sync mode: no rollout before it)."""
        while self.engine.version < version:
            staged = await self.server.pull(self.subscriber)
            if staged is None:  # the store has nothing newer yet
                await asyncio.sleep(0.05)
                continue
            while self.engine.version < staged:
                self.server.check_serving()
                await asyncio.sleep(0.002)

    async def _follow(self) -> None:
        """Pull each newly published version. While the store fails, keep serving the
        weights held and retry with backoff."""
        delay = RETRY_S
        while True:
            if self.poll_s is None:
                await self._published.wait()
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._published.wait(), timeout=self.poll_s)
            self._published.clear()
            try:
                await self.server.pull(self.subscriber)
                delay = RETRY_S
            except StoreError as e:
                self.pull_failures += 1
                log.warning("rl.pull_failed", failures=self.pull_failures, error=str(e))
                await asyncio.sleep(delay)
                delay = min(2 * delay, RETRY_MAX_S)
                self._published.set()  # try again (a newer version may be there by then)

    async def stats(self) -> RolloutStats:
        es = self.engine.stats
        return RolloutStats(
            tokens_sampled=es.tokens_sampled,
            tokens_fed=es.tokens_fed,
            tokens_reused=es.tokens_reused,
            engine_version=self.engine.version,
            pause_s=list(es.pause_seconds),
            prepare_s=list(self.server.prepare_seconds),
            sync_bytes=self.server.sync_bytes,
            pull_failures=self.pull_failures,
            busy_s=self.server.busy_seconds,
        )

    async def close(self) -> None:
        await cancel_and_wait(self._tasks[1:])
        self.server.close()
        await asyncio.gather(*self._tasks[:1], return_exceptions=True)
        self.subscriber.close()  # its decode and download threads
