"""Cross-region weight flow: an S3 origin, a relay per region, several engines per region.

A region's engines pull every version through their relay, which must fetch each object
from the origin once, however many engines ask for it at the same time.
"""

from __future__ import annotations

import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tandem.delta_sync import (
    HttpStore,
    IntegrityError,
    LocalStore,
    Publisher,
    RelayStore,
    StoreError,
    Subscriber,
)
from tandem.delta_sync.manifest import LATEST_KEY
from tandem.delta_sync.server import StoreServer
from tandem.delta_sync.stores.base import Store

SMALL = {"chunk_bytes": 1 << 16, "shard_bytes": 1 << 17}


class CountingStore(Store):
    """Forwards to `inner`, counting GETs per key (what a region takes from the origin)."""

    read_only = True

    def __init__(self, inner: Store, corrupt: str = "") -> None:
        self.inner = inner
        self.corrupt = corrupt  # flip a byte of objects whose key starts with this
        self.gets: Counter[str] = Counter()
        self.bytes = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes:
        data = self.inner.get(key)
        with self._lock:
            self.gets[key] += 1
            self.bytes += len(data)
        if self.corrupt and key.startswith(self.corrupt):
            data = bytes([data[0] ^ 1]) + data[1:]
        return data

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def put(self, key: str, data: bytes) -> None:
        raise self._read_only_error(key)

    def describe(self) -> str:
        return f"counting {self.inner.describe()}"


def _http(url: str) -> HttpStore:
    return HttpStore(url, retries=0, timeout=20)


def test_each_region_downloads_each_object_once(s3_store, tmp_path, trainer, same_bits) -> None:
    regions = {}
    for name in ("eu", "us"):
        origin = CountingStore(s3_store)
        relay = RelayStore(origin, LocalStore(tmp_path / name))
        regions[name] = (origin, relay, StoreServer(relay).start())
    pub = Publisher(s3_store, anchor_every=3, **SMALL)
    keys = [(name, i) for name in regions for i in range(3)]
    engines = {key: {k: np.zeros_like(v) for k, v in trainer.snapshot().items()} for key in keys}
    subs = {key: Subscriber(_http(regions[key[0]][2].url)) for key in keys}
    engine_bytes = 0  # what one engine downloads over the run
    try:
        with ThreadPoolExecutor(len(keys)) as pool:  # a region's engines pull at once
            for v in range(5):
                state = trainer.step()
                pub.publish(v, state)
                reports = list(pool.map(lambda key: subs[key].pull(engines[key]), keys))
                assert [r.version for r in reports] == [v] * len(keys)
                assert len({r.downloaded_bytes for r in reports}) == 1
                engine_bytes += reports[0].downloaded_bytes
                for key in keys:
                    same_bits(engines[key], state)
        fetched = []
        for name, (origin, relay, _) in regions.items():
            objects = {k: n for k, n in origin.gets.items() if k != LATEST_KEY}
            fetched.append(set(objects))
            assert max(objects.values()) == 1, f"{name} fetched an object twice: {objects}"
            assert relay.stats.origin_gets == len(objects)
            # three engines per region: two of every three requests come from the cache
            assert relay.stats.cache_hits >= 2 * len(objects)
            shard_bytes = sum(len(s3_store.get(k)) for k in objects if k.startswith("shards/"))
            assert shard_bytes == engine_bytes  # the region took one engine's worth
            assert origin.gets[LATEST_KEY] == relay.stats.latest_gets >= 5
        assert fetched[0] == fetched[1]
    finally:
        for _, _, server in regions.values():
            server.stop()


def test_relay_refuses_a_corrupt_shard_and_caches_nothing(local_store, tmp_path, trainer) -> None:
    Publisher(local_store, **SMALL).publish(0, trainer.step())
    origin = CountingStore(local_store, corrupt="shards/")
    cache = LocalStore(tmp_path / "cache")
    relay = RelayStore(origin, cache)
    shard = next(k for k in _keys(local_store) if k.startswith("shards/"))
    with pytest.raises(IntegrityError, match="corrupt"):
        relay.get(shard)
    assert not cache.exists(shard)
    with StoreServer(relay) as server, pytest.raises(StoreError, match="502"):
        Subscriber(_http(server.url)).pull(
            {k: np.zeros_like(v) for k, v in trainer.snapshot().items()}
        )
    origin.corrupt = ""  # the origin is repaired: the relay now serves and caches it
    assert relay.get(shard) == local_store.get(shard)
    assert cache.exists(shard)


def test_relay_holds_latest_for_its_ttl_only(local_store, tmp_path, trainer) -> None:
    pub = Publisher(local_store, **SMALL)
    pub.publish(0, trainer.step())
    held = RelayStore(local_store, LocalStore(tmp_path / "a"), latest_ttl=3600)
    exact = RelayStore(local_store, LocalStore(tmp_path / "b"))
    assert held.get(LATEST_KEY) == exact.get(LATEST_KEY)
    pub.publish(1, trainer.step())
    assert Subscriber(exact).latest() == 1
    assert Subscriber(held).latest() == 0  # within its TTL: the pointer it fetched
    assert held.stats.latest_gets == 1
    with pytest.raises(StoreError, match="read-only"):
        exact.put(LATEST_KEY, b"{}")


def _keys(store: LocalStore) -> list[str]:
    return sorted(str(p.relative_to(store.root)) for p in store.root.rglob("*") if p.is_file())


class FullDisk(LocalStore):
    def put(self, key: str, data: bytes) -> None:
        raise StoreError(f"writing {key!r}: disk full (ENOSPC)")


def test_relay_serves_what_it_cannot_cache(local_store, tmp_path, trainer, same_bits) -> None:
    state = trainer.step()
    Publisher(local_store, **SMALL).publish(0, state)
    relay = RelayStore(local_store, FullDisk(tmp_path / "cache"))
    same_bits(Subscriber(relay).materialize(), state)
    assert relay.stats.cache_errors == relay.stats.origin_gets > 0


def test_one_relay_serves_streams_under_any_prefix(tmp_path, trainer, same_bits) -> None:
    """A relay in front of a bucket of streams (``stream-0000/``, ``stream-0001/`` ...): each
    stream's `latest` stays live and its shards are still verified."""
    root = LocalStore(tmp_path / "origin")
    relay = RelayStore(root, LocalStore(tmp_path / "cache"))
    with StoreServer(relay) as server:
        for name in ("stream-0000", "stream-0001"):
            origin = LocalStore(tmp_path / "origin" / name)
            pub = Publisher(origin, **SMALL)
            engine = {k: np.zeros_like(v) for k, v in trainer.snapshot().items()}
            sub = Subscriber(_http(f"{server.url}/{name}"))
            for version in range(3):
                pub.publish(version, trainer.step())
                assert sub.latest() == version  # not a stale cached pointer
                sub.pull(engine)
                same_bits(engine, trainer.snapshot())
        shard = next(k for k in _keys(root) if "/shards/" in k)
        assert relay.cache.exists(shard)
        corrupt = RelayStore(
            CountingStore(root, corrupt="stream-0001/shards/"), LocalStore(tmp_path / "c2")
        )
        bad = next(k for k in _keys(root) if k.startswith("stream-0001/shards/"))
        with pytest.raises(IntegrityError, match="corrupt"):
            corrupt.get(bad)
