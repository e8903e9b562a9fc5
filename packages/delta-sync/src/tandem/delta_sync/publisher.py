"""Publish a version after every trainer step: a delta (plus a catch-up delta), or an anchor.

Order of writes, which is what makes a version atomic for readers: all shards (content-
addressed, skipped if already present), then the manifest, then the `latest` pointer.
A publisher killed at any point leaves the previous version intact; running the same
publish again re-uses the shards that were already uploaded.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import structlog

from tandem.delta_sync.aliases import check_same_ties, split_aliases
from tandem.delta_sync.base_copy import keep_copy
from tandem.delta_sync.codec.encoder import encode_state, tensor_infos
from tandem.delta_sync.errors import DeltaSyncError, StoreError
from tandem.delta_sync.group import (
    await_commit,
    check_group,
    check_publishable,
    commit_group,
    commit_version,
    write_part,
)
from tandem.delta_sync.manifest import (
    Latest,
    Manifest,
    Part,
    PartRecord,
    Payload,
    read_latest,
)
from tandem.delta_sync.mapped_base import MappedBase, adopt_mapped
from tandem.delta_sync.parallel import KeptPool, default_workers
from tandem.delta_sync.reports import PayloadReport, PublishReport
from tandem.delta_sync.stores.base import Store
from tandem.delta_sync.subscriber import Subscriber
from tandem.delta_sync.tensor_view import TensorView
from tandem.delta_sync.tensors import view_of, views_of
from tandem.delta_sync.uploads import ShardUploads

log = structlog.get_logger()

Progress = Callable[[str, int], None]  # (phase, bytes just done)
# phases: "rebuild" (a fresh publisher downloading its base), "encode", "upload"


class Publisher:
    """Publishes versions of a state (name -> numpy array or torch tensor) into a store.

    Keeps a copy of the last published version (and of the last anchor, for catch-up
    deltas) on the tensors' device. A fresh Publisher on a non-empty store first rebuilds
    that copy from the store, so a restarted trainer continues the same stream.

    The state must not change while `publish` runs (publish a snapshot, or publish between
    optimizer steps).

    Per-rank publishing: every rank of a sharded trainer runs its own Publisher with
    `part` = its name and the same `group` (all the names; the first commits), and publishes
    only its own tensors; see `group`.

    Tied tensors (one tensor under two names, e.g. an embedding and the output head) are
    stored once and recorded as aliases; the tying must stay the same within a stream.
    A read-only store (`HttpStore`, `RelayStore`) is refused here, before any work.

    `base_dir` keeps the copies of host tensors memory-mapped in files there instead of in
    memory (for a model larger than the host's spare memory; see `base_copy`).
    `mapped_base` keeps no copy at all when the state is read-only memory-mapped files
    (`load_safetensors(path, mmap_mode="r")`): their mapping is the base for the next step,
    and a published file must never be written again (see `mapped_base`).
    """

    def __init__(
        self,
        store: Store,
        *,
        anchor_every: int = 25,
        shard_bytes: int = 32 << 20,
        chunk_bytes: int = 4 << 20,
        workers: int | None = None,
        upload_workers: int = 4,
        level: int = 1,
        catchup: bool = True,
        part: str = "main",
        group: Sequence[str] | None = None,
        commit_timeout: float = 600.0,
        progress: Progress | None = None,
        base_dir: str | Path | None = None,
        mapped_base: bool = False,
    ) -> None:
        if anchor_every < 1:
            raise DeltaSyncError(f"anchor_every must be >= 1, got {anchor_every}")
        if not (1 << 16) <= chunk_bytes <= (1 << 30):
            raise DeltaSyncError(f"chunk_bytes must be in [64 KiB, 1 GiB], got {chunk_bytes}")
        if shard_bytes < chunk_bytes:
            raise DeltaSyncError("shard_bytes must be at least chunk_bytes")
        if store.read_only:
            raise StoreError(
                f"cannot publish to {store.describe()}: it is a read-only store "
                f"({type(store).__name__}); publish to the origin (a directory, file:// or "
                "s3://) that it serves"
            )
        self.store = store
        self.anchor_every = anchor_every
        self.shard_bytes = shard_bytes
        self.chunk_bytes = chunk_bytes
        self.workers = workers or default_workers()
        self.upload_workers = upload_workers
        self.level = level
        self.catchup = catchup
        self.part = part
        self.group = None if group is None else check_group(part, group)
        self.commit_timeout = commit_timeout
        self.progress = progress
        self.base_dir = None if base_dir is None else Path(base_dir)
        self.mapped_base = mapped_base
        self._mapped: dict[str, MappedBase] = {}  # "prev"/"anchor": a base that is a mapping
        self._prev: dict[str, TensorView] | None = None
        self._prev_manifest: Manifest | None = None
        self._aliases: dict[str, str] = {}  # tied tensors of the last version
        self._anchor: dict[str, TensorView] | None = None
        self._anchor_manifest: Manifest | None = None
        self._resumed = False
        self._pool = KeptPool(self.workers, "delta-sync-encode")
        self._io = KeptPool(upload_workers, "delta-sync-upload")

    def close(self) -> None:
        """Stop the worker threads (started again if the publisher is used afterwards)."""
        self._pool.close()
        self._io.close()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def version(self) -> int | None:
        """The last version published (by this object or found in the store)."""
        return None if self._prev_manifest is None else self._prev_manifest.version

    def _resume(self) -> None:
        """Rebuild the base (and anchor) of the stream from the store, once (and again on the
        next publish if the store fails meanwhile)."""
        latest = read_latest(self.store)
        if latest is None:
            self._resumed = True
            return
        parts = None if self.group is None else [self.part]  # a rank rebuilds its own tensors
        progress = self.progress
        sub = Subscriber(
            self.store,
            workers=self.workers,
            parts=parts,
            progress=None if progress is None else lambda _, n: progress("rebuild", n),
        )
        try:
            self._rebuild(sub, latest)
        finally:
            sub.close()
        self._resumed = True

    def _rebuild(self, sub: Subscriber, latest: Latest) -> None:
        log.info("delta_sync.publisher_resume", version=latest.version)
        m = sub.manifest(latest.version)
        arrays = sub.materialize(latest.version)
        self._prev = {n: view_of(n, arrays[n]) for n in m.tensors(sub.parts)}  # stored ones
        self._prev_manifest = m
        self._aliases = m.aliases(sub.parts)
        if m.anchor_version == m.version:
            self._anchor_manifest = m
            if self.catchup:  # its own copy: _prev is advanced in place by the next publish
                self._anchor = keep_copy(self._prev, self.base_dir)
        else:
            self._anchor_manifest = sub.manifest(m.anchor_version)
            if self.catchup:
                arrays = sub.materialize(m.anchor_version)
                self._anchor = {n: view_of(n, arrays[n]) for n in m.tensors(sub.parts)}

    def publish(self, version: int, state: Mapping[str, Any]) -> PublishReport:
        t0 = time.perf_counter()
        if not isinstance(version, int) or version < 0:
            raise DeltaSyncError(f"version must be a non-negative int, got {version!r}")
        unique, aliases = split_aliases(state)  # tied tensors are stored once
        views = views_of(unique)
        self._drop_changed_bases()
        first = not self._resumed
        if first:
            self._resume()
        last = None if self._prev_manifest is None else self._prev_manifest.version
        if last is not None and version <= last:
            raise DeltaSyncError(
                f"cannot publish version {version}: version {last} is already published "
                "(versions must strictly increase)"
            )
        if last is not None:
            check_same_ties(self._aliases, aliases, last)
        # The store is checked (two round trips to an object store) while the version
        # encodes; nothing is committed before the check has passed.
        store_check = self._io.get().submit(check_publishable, self.store, version, last)
        if first:
            store_check.result()  # a new publisher fails before doing any work

        prev, anchor = self._prev_manifest, self._anchor_manifest
        is_anchor = prev is None or anchor is None or version - anchor.version >= self.anchor_every
        if self.catchup and not is_anchor and self._anchor is None:
            is_anchor = True  # no anchor copy to diff against: start a new epoch
        plan: list[tuple[int | None, dict[str, TensorView] | None]] = []
        if is_anchor:
            plan.append((None, None))
        if prev is not None:  # an anchor also gets a step delta: readers one behind stay cheap
            plan.append((prev.version, self._prev))
        if not is_anchor and self.catchup and anchor is not None and anchor is not prev:
            plan.append((anchor.version, self._anchor))

        payloads: list[Payload] = []
        reports: list[PayloadReport] = []
        digests: dict[str, str] = {}
        adopted = adopt_mapped(views) if self.mapped_base else None
        try:
            pool, io = self._pool.get(), self._io.get()  # kept: no thread start per version
            for i, (base_version, base_views) in enumerate(plan):
                # the step delta turns the publisher's own copy of the previous version
                # into this one in place (no full copy of the model per step), unless the
                # state's own mapping becomes the base
                advance = (
                    base_views is not None
                    and base_views is self._prev
                    and adopted is None
                    and "prev" not in self._mapped
                )
                payload, report, stats_digests = self._publish_payload(
                    version,
                    views,
                    base_version,
                    base_views,
                    pool,
                    io,
                    hash_new=i == 0,
                    advance_base=advance,
                )
                if i == 0:
                    digests = stats_digests
                payloads.append(payload)
                reports.append(report)
            store_check.result()
            part = Part(self.part, tensor_infos(views, digests), payloads, aliases)
            anchor_version = version if is_anchor else anchor.version  # type: ignore[union-attr]
            manifest = self._commit(version, anchor_version, part)
        except BaseException:
            if adopted is not None:
                adopted.close()
            if self._prev is not None:  # partly advanced: rebuild it from the store next time
                self._forget()
            raise
        self._keep(views, adopted, is_anchor)
        if is_anchor:
            self._anchor_manifest = manifest
        self._prev_manifest = manifest
        self._aliases = aliases
        numel = sum(v.numel for v in views.values())
        report = PublishReport(
            version=version,
            anchor_version=manifest.anchor_version,
            is_anchor=is_anchor,
            dense_bytes=manifest.dense_bytes,
            numel=numel,
            payloads=reports,
            seconds=time.perf_counter() - t0,
        )
        log.info(
            "delta_sync.published",
            version=version,
            anchor=is_anchor,
            step_bytes=report.step_bytes,
            ratio=round(report.ratio, 1),
            seconds=round(report.seconds, 3),
        )
        return report

    def _keep(
        self, views: dict[str, TensorView], adopted: MappedBase | None, is_anchor: bool
    ) -> None:
        """The published version becomes the base (and the anchor's): the state's own
        mapping when adopted, else the copy advanced in place, or a new copy."""
        old = dict(self._mapped)
        if adopted is not None:
            self._prev, self._mapped["prev"] = adopted.views, adopted
        elif self._prev is None or self._mapped.pop("prev", None) is not None:
            self._prev = keep_copy(views, self.base_dir)  # no copy of ours was advanced
        if is_anchor:
            self._mapped.pop("anchor", None)
            if not self.catchup:
                self._anchor = None
            elif adopted is not None:
                self._anchor, self._mapped["anchor"] = adopted.views, adopted
            else:
                self._anchor = keep_copy(views, self.base_dir)
        for base in old.values():
            if all(base is not kept for kept in self._mapped.values()):
                base.close()

    def _forget(self) -> None:
        """Drop the bases: the next publish rebuilds them from the store."""
        for base in set(self._mapped.values()):
            base.close()
        self._mapped = {}
        self._prev = self._prev_manifest = self._anchor = self._anchor_manifest = None
        self._aliases = {}
        self._resumed = False

    def _drop_changed_bases(self) -> None:
        """A base that is a caller's mapped file which changed since: rebuilt from the store."""
        for base in self._mapped.values():
            why = base.changed()
            if why is not None:
                log.warning("delta_sync.mapped_base_changed", reason=why, action="rebuild")
                self._forget()
                return

    def _commit(self, version: int, anchor_version: int, part: Part) -> Manifest:
        """Make the version visible: manifest, then `latest` (for a group, once every rank's
        part is there; the other ranks wait for it)."""
        try:
            if self.group is not None:
                record = PartRecord(version, anchor_version, self.chunk_bytes, part)
                write_part(self.store, record)
                if self.part != self.group[0]:
                    return await_commit(self.store, version, self.group[0], self.commit_timeout)
                return commit_group(self.store, record, self.group, self.commit_timeout)
            return commit_version(self.store, version, anchor_version, self.chunk_bytes, [part])
        except StoreError as e:
            raise StoreError(
                f"publishing version {version}: the shards are uploaded but the commit failed "
                f"({e}); publish version {version} again to finish"
            ) from e

    def _publish_payload(
        self,
        version: int,
        views: dict[str, TensorView],
        base_version: int | None,
        base_views: dict[str, TensorView] | None,
        pool: ThreadPoolExecutor,
        io: ThreadPoolExecutor,
        *,
        hash_new: bool,
        advance_base: bool,
    ) -> tuple[Payload, PayloadReport, dict[str, str]]:
        what = "anchor" if base_version is None else f"delta from {base_version}"
        progress = self.progress
        uploads = ShardUploads(
            self.store,
            io,
            self.upload_workers,
            f"publishing version {version} ({what})",
            on_upload=(lambda n: progress("upload", n)) if progress else None,
        )
        on_chunk = (lambda n: progress("encode", n)) if progress else None
        try:
            stats = encode_state(
                views,
                base_views,
                chunk_bytes=self.chunk_bytes,
                level=self.level,
                pool=pool,
                shard_bytes=self.shard_bytes,
                on_shard=uploads.add,
                hash_new=hash_new,
                advance_base=advance_base,
                on_chunk=on_chunk,
            )
            uploads.finish()
        finally:
            uploads.abandon()
        kind = "full" if base_version is None else "delta"
        base_digest = None
        if base_version is not None:
            base_m = self._prev_manifest if advance_base else self._anchor_manifest
            base_digest = base_m.digest  # type: ignore[union-attr]
        refs = uploads.refs
        payload = Payload(kind, base_version, base_digest, refs, stats.changed, stats.chunks)
        report = PayloadReport(
            kind,
            base_version,
            payload.nbytes,
            stats.changed,
            stats.chunks,
            len(refs),
            uploaded=uploads.uploaded,
            skipped=uploads.skipped,
        )
        return payload, report, stats.digests
