"""A version downloaded, verified and decoded, waiting for the engine's pause to apply it.

`Subscriber.prepare` builds one while the engine keeps serving; `Prepared.apply` is the pause:
it patches the live tensors in place and moves the subscriber to the new version.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import structlog

from tandem.delta_sync.aliases import bind
from tandem.delta_sync.codec.patch import StagedPatch, apply_patch, check_targets
from tandem.delta_sync.errors import DeltaSyncError
from tandem.delta_sync.manifest import Manifest
from tandem.delta_sync.reports import PullReport

if TYPE_CHECKING:
    from tandem.delta_sync.subscriber import Subscriber

log = structlog.get_logger()

Step = tuple[int, int | None]  # (version, base version or None for its anchor payload)


class Prepared:
    """A version downloaded, verified and decoded; `apply` patches a state with it."""

    def __init__(
        self,
        subscriber: Subscriber,
        manifest: Manifest,
        from_version: int | None,
        path: list[Step],
        patch: StagedPatch | None,
        downloaded: int,
        cached: int,
        prepare_seconds: float,
    ) -> None:
        self.subscriber = subscriber
        self.manifest = manifest
        self.version = manifest.version
        self.from_version = from_version
        self.path = path
        self.patch = patch
        self.downloaded_bytes = downloaded
        self.cached_bytes = cached
        self.prepare_seconds = prepare_seconds
        self.spilled_bytes = 0  # staged streams moved to a file in `cache_dir`

    @property
    def staged_bytes(self) -> int:
        return 0 if self.patch is None else self.patch.nbytes

    def apply(self, state: Mapping[str, Any]) -> PullReport:
        """Patch `state` (which must be at `from_version`) in place; the engine's pause."""
        t0 = time.perf_counter()
        sub = self.subscriber
        label = f"version {self.version}"
        if sub.version != self.from_version:
            raise DeltaSyncError(
                f"{label} was prepared from version {self.from_version} but the subscriber "
                f"is now at {sub.version}; prepare again"
            )
        stored = self.manifest.tensors(sub.parts)
        aliases = self.manifest.aliases(sub.parts)
        views, targets, sources = bind(state, stored, aliases, label)
        check_targets(views, targets, label)
        if self.patch is not None:
            apply_patch(
                self.patch,
                views,
                targets,
                chunk_bytes=self.manifest.chunk_bytes,
                pool=sub._pool.get(),
                label=f"{label} (from {self.from_version})",
                sources=sources,
            )
        sub.version = self.version
        sub.clear_cache()
        report = PullReport(
            version=self.version,
            from_version=self.from_version,
            path=self.path,
            downloaded_bytes=self.downloaded_bytes,
            cached_bytes=self.cached_bytes,
            changed=0 if self.patch is None else self.patch.changed,
            prepare_seconds=self.prepare_seconds,
            apply_seconds=time.perf_counter() - t0,
        )
        log.info(
            "delta_sync.applied",
            version=self.version,
            from_version=self.from_version,
            downloaded=self.downloaded_bytes,
            prepare_s=round(report.prepare_seconds, 3),
            apply_s=round(report.apply_seconds, 3),
        )
        return report
