"""The inference side on vLLM servers: groups played over HTTP, weights followed in place.

`VllmRollouts` is `LocalRollouts`' counterpart for ``engine.kind = "vllm"``: the same
groups and episodes (`play_group`), played on vLLM servers through `VllmEngine`, and the
same weight stream, which each server's plugin pulls and applies in place (`VllmWeights`)
whenever the trainer publishes. Unlike the embedded engine, vLLM's numerics are not the
trainer's: the trainer scores every sample again, and the run reports the gap.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx
import structlog

from tandem.agent_env import Env, EnvConfig, Task
from tandem.moe_determinism.model.hf import HfSource
from tandem.orchestrator.config import EngineConfig, EpisodeConfig
from tandem.orchestrator.inference.formats import AnyChatFormat
from tandem.orchestrator.inference.vllm.engine import VllmEngine
from tandem.orchestrator.inference.vllm.serving import VllmServers
from tandem.orchestrator.inference.vllm.weights import VllmWeights
from tandem.orchestrator.protocols import EngineStopped, WorkerLost
from tandem.orchestrator.rollout.group import play_group
from tandem.orchestrator.rollout.tasks import TaskSource
from tandem.orchestrator.runtime.backoff import RETRY_S, next_delay
from tandem.orchestrator.runtime.cancel import cancel_and_wait
from tandem.orchestrator.wire import PlayedGroup, RolloutStats

log = structlog.get_logger()


class VllmRollouts:
    """vLLM servers (one engine over all of them) following the run's weight stream.

    ``store``: the stream's URL as the servers reach it; ``layout``: the checkpoint's
    names in the stream (`hf_layout`); ``version``: what the servers loaded.
    """

    def __init__(
        self,
        engine: VllmEngine,
        store: str,
        layout: dict[str, HfSource],
        version: int,
        tasks: TaskSource,
        *,
        chat: AnyChatFormat,
        env: EnvConfig,
        episode: EpisodeConfig,
        engine_cfg: EngineConfig,
        seed: int,
        group_size: int,
        servers: VllmServers | None = None,
        open_env: Callable[[Task, EnvConfig], Any] = Env,
    ) -> None:
        self.engine = engine
        self.servers = servers
        self.store, self.layout, self.start_version = store, layout, version
        self.tasks = tasks
        self.chat = chat
        self.env, self.episode, self.engine_cfg = env, episode, engine_cfg
        self.seed, self.group_size = seed, group_size
        self.open_env = open_env
        self.weights = [VllmWeights(url) for url in engine.urls]
        self.pause_s: list[float] = []
        self.prepare_s: list[float] = []
        self.sync_bytes = 0
        self.pull_failures = 0
        self.restarts = 0
        self._published = asyncio.Event()
        self._updating = asyncio.Lock()
        self._tasks: list[asyncio.Task[Any]] = []

    @property
    def version(self) -> int:
        return min(w.version for w in self.weights)

    async def start(self, *, follow: bool) -> list[asyncio.Task[Any]]:
        await asyncio.gather(
            *(w.follow(self.store, self.start_version, self.layout) for w in self.weights)
        )
        if follow:
            self._tasks.append(asyncio.create_task(self._follow()))
        return list(self._tasks)

    async def play(self, index: int, min_version: int = -1) -> PlayedGroup:
        """Group ``index``; a server that fails under it is brought back (restarted on the
        run's start version and updated to the latest), and the group played again
        (`WorkerLost`)."""
        while self.version < min_version:
            await asyncio.sleep(0.01)
        try:
            return await play_group(
                self.engine,
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
        except EngineStopped as e:
            await self._recover(e)
            raise WorkerLost(f"vLLM server failed during group {index}: {e}") from None

    async def _healthy(self) -> bool:
        client = self.engine.http()
        try:
            answers = await asyncio.gather(
                *(client.get(f"{url}/health", timeout=5.0) for url in self.engine.urls)
            )
        except httpx.HTTPError:
            return False
        return all(a.status_code == 200 for a in answers)

    async def _recover(self, error: EngineStopped) -> None:
        """Bring the servers back, or raise ``error`` when tandem cannot (given by URL)."""
        async with self._updating:
            if await self._healthy():
                return  # up (another group's recovery, or the failure was the request's)
            if self.servers is None or not self.servers.restartable:
                raise error
            log.warning("vllm.server_restarting", error=str(error)[:300])
            urls = await asyncio.to_thread(self.servers.restart)
            self.engine.urls = list(urls)
            old, self.weights = self.weights, [VllmWeights(url) for url in urls]
            await asyncio.gather(*(w.close() for w in old))
            await asyncio.gather(
                *(w.follow(self.store, self.start_version, self.layout) for w in self.weights)
            )
            await self._update_now()
            self.restarts += 1
            log.info("vllm.server_restarted", version=self.version, restarts=self.restarts)

    def published(self) -> None:
        self._published.set()

    async def sync_to(self, version: int) -> None:
        while self.version < version:
            if not await self._update():
                await asyncio.sleep(0.05)  # the store has nothing newer yet

    async def _update(self) -> bool:
        """Every server on the latest version; whether any of them moved."""
        async with self._updating:
            return await self._update_now()

    async def _update_now(self) -> bool:
        done = await asyncio.gather(*(w.update() for w in self.weights))
        for update in done:
            if update is not None:
                self.pause_s.append(update.pause_s)
                self.prepare_s.append(update.prepare_s)
                self.sync_bytes += update.downloaded_bytes
                log.debug("vllm.updated", url=update.url, version=update.version)
        return any(u is not None for u in done)

    async def _follow(self) -> None:
        """Update on each publish; while a server cannot prepare, keep serving and retry."""
        delay = RETRY_S
        while True:
            await self._published.wait()
            self._published.clear()
            try:
                await self._update()
                delay = RETRY_S
            except EngineStopped as e:
                self.pull_failures += 1
                log.warning("rl.pull_failed", failures=self.pull_failures, error=str(e))
                await asyncio.sleep(delay)
                delay = next_delay(delay)
                self._published.set()

    async def stats(self) -> RolloutStats:
        return RolloutStats(
            tokens_sampled=self.engine.tokens_sampled,
            tokens_fed=self.engine.tokens_fed,
            engine_version=self.version,
            pause_s=list(self.pause_s),
            prepare_s=list(self.prepare_s),
            sync_bytes=self.sync_bytes,
            pull_failures=self.pull_failures,
            workers=len(self.weights),
        )

    async def close(self) -> None:
        await cancel_and_wait(self._tasks)
        await asyncio.gather(
            self.engine.close(), *(w.close() for w in self.weights), return_exceptions=True
        )
