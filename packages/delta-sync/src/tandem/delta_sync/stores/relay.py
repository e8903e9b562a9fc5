"""A read-through cache in front of an origin store: one per region, so a region downloads
each object of a version once however many engines pull it.

Everything a publisher writes is immutable except `latest`: shards are content-addressed,
and a version's manifest is never rewritten (publishing an existing version is an error).
So shards and manifests are fetched from the origin on the first request, verified,
written to the cache and served from it ever after; concurrent requests for the same
object wait for the one fetch in flight. `latest` is passed through, or held for
`latest_ttl` seconds so that a region's engines polling together cost one origin request.

Serve it over HTTP with `StoreServer(RelayStore(...))` (`delta-sync relay`), and point the
region's engines at it with `HttpStore`.
"""

from __future__ import annotations

import re
import threading
import time

import msgspec
import structlog

from tandem.delta_sync.codec.container import shard_digest
from tandem.delta_sync.errors import IntegrityError, NotFoundError, StoreError
from tandem.delta_sync.manifest import LATEST_KEY, decode_manifest
from tandem.delta_sync.stores.base import Store, check_key

log = structlog.get_logger()

_MANIFEST = re.compile(r"(?:^|/)versions/(\d+)/manifest\.json$")
_SHARD = re.compile(r"(?:^|/)shards/[0-9a-f]{2}/([0-9a-f]+)\.tds$")


def is_latest(key: str) -> bool:
    """The mutable pointer of a stream at the root or under any prefix (one relay may serve
    a whole bucket of streams, e.g. a run's ``stream-NNNN/`` after each resume)."""
    return key == LATEST_KEY or key.endswith("/" + LATEST_KEY)


class RelayStats(msgspec.Struct):
    """What the relay took from the origin and what it served from its cache."""

    origin_gets: int = 0
    origin_bytes: int = 0
    cache_hits: int = 0
    latest_gets: int = 0
    cache_errors: int = 0  # objects served without being kept (the cache could not write)


class RelayStore(Store):
    """Read-only: `get` and `exists` of `origin`, immutable objects kept in `cache`."""

    read_only = True

    def __init__(self, origin: Store, cache: Store, *, latest_ttl: float = 0.0) -> None:
        if cache.read_only:
            raise ValueError(f"the relay's cache must be writable, got {cache.describe()}")
        if latest_ttl < 0:
            raise ValueError(f"latest_ttl must be >= 0 seconds, got {latest_ttl}")
        self.origin = origin
        self.cache = cache
        self.latest_ttl = latest_ttl
        self.stats = RelayStats()
        self._lock = threading.Lock()
        self._fetching: dict[str, threading.Lock] = {}
        self._latest: dict[str, tuple[float, bytes]] = {}

    def describe(self) -> str:
        return f"relay of {self.origin.describe()} (cache {self.cache.describe()})"

    def get(self, key: str) -> bytes:
        return self.get_wait(key, 0.0)

    def get_wait(self, key: str, wait: float) -> bytes:
        """`get`, the origin asked to hold the request until the object appears (a
        subscriber's long-poll for the next manifest passes through to the origin)."""
        check_key(key)
        if is_latest(key):
            return self._get_latest(key)
        try:
            data = self.cache.get(key)
        except NotFoundError:
            return self._fetch(key, wait)
        with self._lock:
            self.stats.cache_hits += 1
        return data

    def exists(self, key: str) -> bool:
        check_key(key)
        if not is_latest(key) and self.cache.exists(key):
            return True
        return self.origin.exists(key)

    def put(self, key: str, data: bytes) -> None:
        raise self._read_only_error(key)

    def close(self) -> None:
        self.origin.close()

    def _get_latest(self, key: str) -> bytes:
        now = time.monotonic()
        with self._lock:
            held = self._latest.get(key)
        if held is not None and now - held[0] < self.latest_ttl:
            return held[1]
        data = self.origin.get(key)
        with self._lock:
            self._latest[key] = (now, data)
            self.stats.latest_gets += 1
        return data

    def _fetch(self, key: str, wait: float = 0.0) -> bytes:
        """Fetch `key` from the origin once, however many threads ask for it at a time (a
        long-poll's `wait` counts the time spent waiting for another thread's fetch)."""
        deadline = time.monotonic() + wait
        with self._lock:
            gate = self._fetching.setdefault(key, threading.Lock())
        with gate:
            wait = deadline - time.monotonic()
            try:
                try:  # a thread that waited on the gate finds it fetched
                    data = self.cache.get(key)
                except NotFoundError:
                    pass
                else:
                    with self._lock:
                        self.stats.cache_hits += 1
                    return data
                data = self.origin.get_wait(key, wait) if wait > 0 else self.origin.get(key)
                with self._lock:
                    self.stats.origin_gets += 1
                    self.stats.origin_bytes += len(data)
                _verify(key, data, self.origin)
                try:
                    self.cache.put(key, data)
                except StoreError as e:  # e.g. the cache disk is full: serve it uncached
                    with self._lock:
                        self.stats.cache_errors += 1
                    log.warning("delta_sync.relay_cache_failed", key=key, error=str(e))
                return data
            finally:
                with self._lock:
                    self._fetching.pop(key, None)


def _verify(key: str, data: bytes, origin: Store) -> None:
    """A shard's key is its xxh3-128 and a manifest names its version: a corrupt copy is
    refused, never cached."""
    version = _MANIFEST.search(key)
    if version is not None:
        decode_manifest(data, int(version.group(1)))
    elif (shard := _SHARD.search(key)) is not None:
        expected = shard.group(1)
        actual = shard_digest(data)
        if actual != expected:
            raise IntegrityError(
                f"{key} from {origin.describe()} has digest {actual}: corrupt in the origin or "
                "in transit; not cached"
            )
