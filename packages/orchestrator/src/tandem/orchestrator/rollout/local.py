"""The inference side of one engine in this process: it plays groups and follows the weights.

`LocalRollouts` is the whole inference side of one embedded engine: the engine, its asyncio
server, the subscriber it pulls new policy versions with, and `play` for one GRPO group
(`Rollouts`). The ``local`` backend drives one in the run's process; on the ``ray`` backend
every rollout actor holds one. Either way a group depends only on (task, seed, group index)
and the weights it was played with: the engine is batch-invariant, so where a group runs
and what shares its batches does not change its samples.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import structlog

from tandem.agent_env import Env, EnvConfig, Task
from tandem.delta_sync import StoreError, Subscriber, warm_up
from tandem.orchestrator.config import EngineConfig, EpisodeConfig
from tandem.orchestrator.inference.embedded.engine import InferenceEngine
from tandem.orchestrator.inference.embedded.server import EngineServer
from tandem.orchestrator.inference.formats import AnyChatFormat
from tandem.orchestrator.rollout.group import play_group
from tandem.orchestrator.rollout.tasks import TaskSource
from tandem.orchestrator.runtime.backoff import RETRY_S, next_delay
from tandem.orchestrator.runtime.cancel import cancel_and_wait
from tandem.orchestrator.wire import PlayedGroup, RolloutStats

log = structlog.get_logger()


class LocalRollouts:
    """One engine, its server and its weight subscriber; plays groups on request.

    ``poll_s``: also look for a new version this often without being told (an engine that
    may miss a notification, e.g. one that joined late or runs far from the trainer).
    ``open_env``: makes each episode's environment (default: a sandbox in this process).
    ``chat``: the policy's chat format (`chat_format_for` its path); its end-of-turn id is
    the engine's stop id.
    """

    def __init__(
        self,
        engine: InferenceEngine,
        subscriber: Subscriber,
        tasks: TaskSource,
        *,
        chat: AnyChatFormat,
        env: EnvConfig,
        episode: EpisodeConfig,
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
        self.env, self.episode, self.engine_cfg = env, episode, engine_cfg
        self.seed, self.group_size = seed, group_size
        self.poll_s = poll_s
        self.chat = chat
        self.pull_failures = 0
        self._published = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []

    @property
    def version(self) -> int:
        return self.engine.version

    async def start(self, *, follow: bool) -> list[asyncio.Task[Any]]:
        """Start serving (and following the weight stream); returns the background tasks.

        delta-sync's compiled kernels get ready while the first groups play, not inside the
        engine's first pause (compiled once per machine, then loaded)."""
        self._tasks = [asyncio.create_task(self.server.serve())]
        if follow:
            self._tasks.append(asyncio.create_task(self._follow()))
        widths = sorted({t.element_size() for t in self.engine.state.values()})
        self._tasks.append(asyncio.create_task(asyncio.to_thread(warm_up, widths)))
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
            episode=self.episode,
            engine_cfg=self.engine_cfg,
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
                delay = next_delay(delay)
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
        await cancel_and_wait(self._tasks[1:])  # all but the server, which closes itself
        self.server.close()
        await asyncio.gather(*self._tasks[:1], return_exceptions=True)
        self.subscriber.close()  # its decode and download threads
