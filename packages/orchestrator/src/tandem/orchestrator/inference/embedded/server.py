"""An asyncio front for the inference engine: many episodes await turns, one loop decodes.

Episodes call `generate` concurrently; the serving loop runs `InferenceEngine.step` in a
worker thread (so sandboxed tool calls keep flowing on the event loop while the model
computes) and resolves each turn as it finishes. New policy versions are prepared (download,
verify, decode) in another thread while the engine serves, then staged; the engine applies
them between two decoding steps.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import structlog
import torch

from tandem.orchestrator.inference.embedded.engine import InferenceEngine
from tandem.orchestrator.protocols import EngineStopped
from tandem.orchestrator.wire import TurnOutput

log = structlog.get_logger()


class EngineServer:
    """Serves `generate` requests from any number of coroutines with one engine: the
    embedded engine's side of `tandem.orchestrator.protocols.Engine`."""

    def __init__(self, engine: InferenceEngine) -> None:
        self.engine = engine
        self._futures: dict[int, asyncio.Future[TurnOutput]] = {}
        self._wake = asyncio.Event()
        self._closed = False
        self._failure: BaseException | None = None
        self._pulling = asyncio.Lock()  # one pull at a time: each prepares from the last
        self._slots = asyncio.Semaphore(engine.free_slots)
        self.busy_seconds = 0.0
        self.prepare_seconds: list[float] = []
        self.sync_bytes = 0

    @property
    def max_len(self) -> int:
        return self.engine.config.max_len

    async def acquire(self) -> int:
        await self._slots.acquire()
        return self.engine.acquire()

    def release(self, slot: int) -> None:
        """Give the slot back, abandoning a turn still in flight (e.g. on cancellation)."""
        if self._futures.pop(slot, None) is not None:
            self.engine.cancel(slot)
        self.engine.release(slot)
        self._slots.release()

    async def generate(
        self,
        slot: int,
        feed: list[int],
        generator: torch.Generator,
        max_new_tokens: int,
        keep_going: Callable[[int], bool] | None = None,
    ) -> TurnOutput:
        self.check_serving()
        fut: asyncio.Future[TurnOutput] = asyncio.get_running_loop().create_future()
        self._futures[slot] = fut
        self.engine.submit(slot, feed, generator, max_new_tokens, keep_going)
        self._wake.set()
        return await fut

    def check_serving(self) -> None:
        """Raise `EngineStopped` once the serving loop has stopped (a waiter would hang)."""
        if self._failure is not None:
            raise EngineStopped(f"inference engine stopped: {self._failure!r}")
        if self._closed:
            raise EngineStopped("inference engine stopped: the server was closed")

    def wake(self) -> None:
        self._wake.set()

    async def serve(self) -> None:
        """Decode until `close`; exceptions fail every waiting turn and propagate."""
        try:
            while not self._closed:
                if not self.engine.busy and self.engine.pending_version is None:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                t0 = time.perf_counter()
                finished = await asyncio.to_thread(self.engine.step)
                self.busy_seconds += time.perf_counter() - t0
                for slot, out in finished:
                    fut = self._futures.pop(slot, None)
                    if fut is not None and not fut.done():
                        fut.set_result(out)
                if not self.engine.busy:
                    await asyncio.sleep(0)
        except BaseException as e:
            self._failure = e
            for fut in self._futures.values():
                if not fut.done():
                    fut.set_exception(EngineStopped(f"inference engine stopped: {e!r}"))
            raise

    def close(self) -> None:
        self._closed = True
        self._wake.set()

    async def pull(self, subscriber: Any, version: int | None = None) -> int | None:
        """Prepare ``version`` (default: latest) off the event loop and stage it.

        Pulls are serialised (a periodic one and a requested one may overlap): each
        prepares from the version the previous one staged, once that is applied.
        """
        async with self._pulling:
            while self.engine.pending_version is not None:
                self.check_serving()
                await asyncio.sleep(0.005)  # the staged version is based on the current one
            t0 = time.perf_counter()
            prepared = await asyncio.to_thread(subscriber.prepare, version)
            if prepared.version <= self.engine.version:
                return None
            self.prepare_seconds.append(time.perf_counter() - t0)
            self.sync_bytes += prepared.downloaded_bytes
            self.engine.stage_update(prepared)
            self._wake.set()
            return prepared.version
