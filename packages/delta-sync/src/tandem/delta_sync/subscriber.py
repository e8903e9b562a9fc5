"""Pull published versions: plan the cheapest path, download and verify, stage, apply.

Two phases so an inference engine keeps serving while a version downloads:

    prepared = subscriber.prepare()      # download + verify + decode (no pause)
    report = prepared.apply(state)       # patch the live tensors in place (the pause)

Path planning: from the version the state is at, either follow the step deltas, or (when
that would cost more bytes, or the state is unknown) take the newest anchor plus one
catch-up delta, so a reader any number of versions behind downloads at most about one
anchor's worth of bytes.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from tandem.delta_sync.aliases import restore_aliases
from tandem.delta_sync.codec.container import shard_digest
from tandem.delta_sync.codec.patch import stage
from tandem.delta_sync.dtypes import numpy_dtype
from tandem.delta_sync.errors import DeltaSyncError, IntegrityError, NotFoundError, StoreError
from tandem.delta_sync.manifest import Manifest, decode_manifest, manifest_key, read_latest
from tandem.delta_sync.parallel import KeptPool, default_workers, ordered_map
from tandem.delta_sync.prepared import Prepared, Step
from tandem.delta_sync.reports import PullReport
from tandem.delta_sync.spill import Spill
from tandem.delta_sync.stores.base import Store, nothing_published

log = structlog.get_logger()


def _mapped(path: Path) -> memoryview:
    """A cached shard, memory-mapped read-only: a version staged through `cache_dir` (an
    anchor of a model larger than memory) lives in the page cache, not in the process."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return memoryview(b"")
        return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))


class Subscriber:
    """Follows a store. `version` is the version the caller's state is at (None: unknown).

    `max_chain` bounds how many step deltas a pull may chain before it prefers the anchor
    plus one catch-up delta; `cache_dir` keeps verified shards on disk so an interrupted
    prepare resumes without downloading them again (in memory otherwise). `parts` limits
    the pull to the tensors of those parts of a version published per rank (default: all,
    reassembled into one state). With `cache_dir`, staged shards are memory-mapped from
    there, and a delta's decoded streams are moved to an unlinked file there shard by shard,
    so preparing an anchor or a delta of a model larger than memory needs only a few shards
    of the process's own memory.
    """

    def __init__(
        self,
        store: Store,
        *,
        workers: int | None = None,
        download_workers: int = 8,
        version: int | None = None,
        cache_dir: str | Path | None = None,
        max_chain: int = 4,
        parts: Collection[str] | None = None,
        progress: Callable[[str, int], None] | None = None,
    ) -> None:
        self.store = store
        self.parts = None if parts is None else frozenset(parts)
        self.max_chain = max_chain
        self.workers = workers or default_workers()
        self.download_workers = download_workers
        self.version = version
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.progress = progress
        self._manifests: dict[int, Manifest] = {}
        self._shards: dict[str, bytes] = {}  # verified shards kept for a retried prepare
        self._pool = KeptPool(self.workers, "delta-sync-decode")
        self._io = KeptPool(download_workers, "delta-sync-download")

    def close(self) -> None:
        """Stop the worker threads (started again if the subscriber is used afterwards)."""
        self._pool.close()
        self._io.close()
        self.store.close()

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def latest(self) -> int | None:
        latest = read_latest(self.store)
        return None if latest is None else latest.version

    def _latest_and_next(self, wait: float = 0.0) -> int | None:
        """`latest`, with the manifest of the version after ours asked for at the same time:
        a subscriber one step behind (the usual case) then has both after one round trip,
        not two; if no such version exists yet, the guess costs one small request. With
        `wait`, the manifest's request is a long-poll: held by the store until that version
        is published (its manifest is written once all its shards are in), so the
        subscriber learns of it half a round trip after the commit, not a poll later."""
        guess = None if self.version is None else self.version + 1
        if guess is None or guess in self._manifests:
            return self.latest()
        ahead = self._io.get().submit(self._manifest_if_there, guess, wait)
        try:
            latest = self.latest()
        finally:
            ahead.result()
        if guess in self._manifests and (latest is None or latest < guess):
            return guess  # published while the request waited
        return latest

    def _manifest_if_there(self, version: int, wait: float = 0.0) -> None:
        with contextlib.suppress(DeltaSyncError):  # not yet published, or unreadable: `prepare`
            if wait > 0 and version not in self._manifests:
                data = self.store.get_wait(manifest_key(version), wait)
                self._manifests[version] = decode_manifest(data, version)
            self.manifest(version)  # asks again for the version `latest` names

    def manifest(self, version: int) -> Manifest:
        if version not in self._manifests:
            try:
                data = self.store.get(manifest_key(version))
            except NotFoundError:
                raise NotFoundError(
                    f"version {version} has no manifest in {self.store.describe()}: it was "
                    "never published, or its publish did not finish"
                ) from None
            self._manifests[version] = decode_manifest(data, version)
        return self._manifests[version]

    def plan(self, target: int, from_version: int | None) -> list[Step]:
        """The cheapest sequence of payloads (in bytes) from `from_version` to `target`."""
        best, best_cost = self._plan_from_anchor(target)
        if from_version is None:
            return best
        steps: list[Step] = []
        cost, v = 0, target
        while True:
            mv = self.manifest(v)
            bases = mv.bases()
            if from_version in bases and cost + mv.payload_bytes(from_version) < best_cost:
                best = list(reversed([*steps, (v, from_version)]))
                best_cost = cost + mv.payload_bytes(from_version)
            prev = mv.step_base()
            if prev is None or prev <= from_version or len(steps) + 1 >= self.max_chain:
                break
            cost += mv.payload_bytes(prev)
            if cost >= best_cost:
                break
            steps.append((v, prev))
            v = prev
        return best

    def _plan_from_anchor(self, target: int) -> tuple[list[Step], int]:
        """(path, bytes) from nothing: the anchor, then its catch-up delta to `target`, or,
        for a stream published without catch-up deltas, the step deltas after the anchor."""
        m = self.manifest(target)
        if m.anchor_version == target:
            return [(target, None)], m.payload_bytes(None)
        cost = self.manifest(m.anchor_version).payload_bytes(None)
        if m.anchor_version in m.bases():
            return [(m.anchor_version, None), (target, m.anchor_version)], cost + m.payload_bytes(
                m.anchor_version
            )
        steps: list[Step] = []
        v = target
        while v != m.anchor_version:
            mv = self.manifest(v)
            prev = mv.step_base()
            if prev is None or prev < m.anchor_version:
                raise IntegrityError(
                    f"version {target}: no path from its anchor {m.anchor_version} (version {v} "
                    "has neither a catch-up delta nor a step delta after the anchor)"
                )
            cost += mv.payload_bytes(prev)
            steps.append((v, prev))
            v = prev
        return [(m.anchor_version, None), *reversed(steps)], cost

    def clear_cache(self) -> None:
        self._shards.clear()

    def _fetch(self, key: str, digest: str, where: str) -> tuple[bytes | memoryview, bool]:
        """(verified shard bytes, whether they came from a cache)."""
        if key in self._shards:
            return self._shards[key], True
        cached = self.cache_dir / key if self.cache_dir is not None else None
        if cached is not None and cached.is_file():
            data = _mapped(cached)
            if shard_digest(data) == digest:
                return data, True
        try:
            data = self.store.get(key)
        except NotFoundError:
            raise NotFoundError(f"{where}: missing from {self.store.describe()}") from None
        except StoreError as e:
            raise StoreError(f"{where}: {e}; nothing was applied, prepare again") from e
        if shard_digest(data) != digest:
            raise IntegrityError(
                f"{where}: {len(data)} bytes whose xxh3-128 does not match the manifest "
                "(truncated or corrupted); nothing was applied"
            )
        if cached is not None:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_suffix(".tmp")
            try:
                tmp.write_bytes(data)
                tmp.replace(cached)
                return _mapped(cached), False  # staged from the page cache, not from memory
            except OSError as e:
                tmp.unlink(missing_ok=True)
                raise StoreError(f"{where}: cannot write the shard cache {cached}: {e}") from e
        self._shards[key] = data
        return data, False

    def prepare(self, version: int | None = None, *, wait: float = 0.0) -> Prepared:
        """Download, verify and decode `version` (default: the latest) without touching state.

        `wait` (seconds, with no `version`): if nothing newer than ours is published yet,
        wait up to that long for the next version (a long-poll; see `_latest_and_next`)."""
        t0 = time.perf_counter()
        target = self._latest_and_next(wait) if version is None else version
        if target is None:
            raise nothing_published(self.store)
        m = self.manifest(target)
        if self.version is not None and target < self.version:
            raise DeltaSyncError(f"cannot go back from version {self.version} to {target}")
        if target == self.version:
            return Prepared(self, m, self.version, [], None, 0, 0, time.perf_counter() - t0)
        path = self.plan(target, self.version)
        jobs: list[tuple[str, str, str]] = []  # (key, digest, where), payloads in order
        for v, base in path:
            mv = self.manifest(v)
            what = "anchor" if base is None else f"delta from {base}"
            for part in mv.parts:
                if self.parts is not None and part.name not in self.parts:
                    continue
                payload = part.payload_from(base)
                if payload is None:
                    raise IntegrityError(f"version {v}: part {part.name!r} lacks its {what}")
                for i, ref in enumerate(payload.shards):
                    where = f"version {v} ({what}) shard {i} ({ref.key})"
                    jobs.append((ref.key, ref.digest, where))
        downloaded = cached = 0

        def arrived() -> Iterator[tuple[bytes | memoryview, str]]:
            """Each shard as its download finishes, in order: staging decodes it while the
            next ones download."""
            nonlocal downloaded, cached
            fetched = ordered_map(
                self._io.get(),
                lambda j: self._fetch(*j),
                jobs,
                2 * self.download_workers,
            )
            try:
                for (_, _, where), (data, hit) in zip(jobs, fetched, strict=True):
                    if hit:
                        cached += len(data)
                    else:
                        downloaded += len(data)
                    if self.progress is not None:
                        self.progress("download", len(data))
                    yield data, where
            finally:  # staging failed or stopped: no download outlives this call
                fetched.close()

        shards = arrived()
        spill = Spill(self.cache_dir) if self.cache_dir is not None else None
        try:
            patch = stage(
                shards,
                m.tensors(self.parts),
                full=bool(path) and path[0][1] is None,
                chunk_bytes=m.chunk_bytes,
                pool=self._pool.get(),
                label=f"version {target}",
                spill=spill,
            )
        finally:
            shards.close()
            if spill is not None:
                spill.close()
        prepared = Prepared(
            self, m, self.version, path, patch, downloaded, cached, time.perf_counter() - t0
        )
        prepared.spilled_bytes = 0 if spill is None else spill.nbytes
        return prepared

    def pull(
        self, state: Mapping[str, Any], version: int | None = None, *, wait: float = 0.0
    ) -> PullReport:
        """prepare + apply in one call."""
        return self.prepare(version, wait=wait).apply(state)

    def materialize(self, version: int | None = None, *, as_torch: bool = False) -> dict[str, Any]:
        """A fresh copy of `version` (default: latest), from its anchor: numpy arrays (bf16
        and fp8 through ml_dtypes), or with `as_torch` torch tensors, bit for bit. A tied
        tensor's names are one array (one tensor)."""
        target = self.latest() if version is None else version
        if target is None:
            raise nothing_published(self.store)
        m = self.manifest(target)
        arrays = {
            n: np.zeros(t.shape, numpy_dtype(t.dtype)) for n, t in m.tensors(self.parts).items()
        }
        restore_aliases(arrays, m.aliases(self.parts))
        helper = Subscriber(
            self.store,
            workers=self.workers,
            download_workers=self.download_workers,
            parts=self.parts,
            progress=self.progress,
        )
        helper._manifests = self._manifests
        try:
            helper.prepare(target).apply(arrays)
        finally:
            helper.close()
        if as_torch:
            from tandem.delta_sync.torch_interop import to_torch

            return to_torch(arrays)
        return arrays
