"""Publishing the trainer's versions, and retrying a publish the weight store refused.

A failing store delays sync without stopping anything: a publish that fails leaves the
version pending and is retried with backoff between trainer steps (each try publishes the
trainer's current version, while its weights cannot change); the engines keep serving the
weights they have meanwhile, and once the store is back one pull brings them to the newest
version.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from tandem.orchestrator.protocols import Rollouts, Trainer, WeightSink
from tandem.orchestrator.rl.hooks import RunHooks
from tandem.orchestrator.runtime.backoff import RETRY_S, next_delay

if TYPE_CHECKING:
    from tandem.delta_sync import PublishReport


class Publishing:
    """The run's publishes. ``busy`` is held while the trainer's weights may change (a step,
    a publish); ``failed`` is set when a step's publish failed."""

    def __init__(
        self,
        sink: WeightSink,
        trainer: Trainer,
        rollouts: Rollouts,
        version: Callable[[], int],
        hooks: RunHooks,
    ) -> None:
        self.sink, self.trainer, self.rollouts = sink, trainer, rollouts
        self.version = version
        self.hooks = hooks
        self.busy = asyncio.Lock()
        self.failed = asyncio.Event()

    def publish(self) -> PublishReport | None:
        """Publish the trainer's version (in a worker thread); None when the store failed."""
        report = self.sink.try_publish(self.version())
        if report is not None and self.hooks.on_publish is not None:
            self.hooks.on_publish(report.version, self.trainer.weights())
        return report

    async def retry_pending(self) -> None:
        """Retry a failed publish with backoff until it is out."""
        delay = RETRY_S
        while self.sink.pending is not None:
            await asyncio.sleep(delay)
            delay = next_delay(delay)
            async with self.busy:
                if self.sink.pending is None:
                    break  # the trainer's own publish got it out while this one waited
                if await asyncio.to_thread(self.publish) is not None:
                    self.rollouts.published()

    async def retry_failed(self) -> None:
        """Async mode's background task: after each failed publish, retry it between trainer
        steps (the trainer may be waiting for data that only fresh weights give)."""
        while True:
            await self.failed.wait()
            self.failed.clear()
            await self.retry_pending()
