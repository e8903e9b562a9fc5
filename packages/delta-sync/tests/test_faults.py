"""Faults: each gives a clear error naming version and shard, applies nothing, keeps the
previous version intact, and a rerun resumes without re-sending what is already there."""

from __future__ import annotations

import errno
import io

import numpy as np
import pytest

from tandem.delta_sync import (
    BaseMismatchError,
    DeltaSyncError,
    IntegrityError,
    LocalStore,
    NotFoundError,
    Publisher,
    StoreError,
    Subscriber,
)
from tandem.delta_sync.manifest import LATEST_KEY, decode_manifest, manifest_key
from tandem.delta_sync.stores import local as local_module
from tandem.delta_sync.stores.base import Store

OPTS = {"chunk_bytes": 1 << 16, "shard_bytes": 1 << 16}
LR = 3e-5  # dense enough that one delta spans several shards


class Killed(BaseException):
    """Stands in for SIGKILL: not an Exception, so nothing may swallow it."""


class CountingStore(Store):
    """Wraps a store; counts shard reads/writes and can fail after a number of them."""

    def __init__(self, inner: Store, *, fail_put_after=None, fail_get_after=None, exc=None):
        self.inner = inner
        self.puts: list[str] = []
        self.gets: list[str] = []
        self.fail_put_after = fail_put_after
        self.fail_get_after = fail_get_after
        self.exc = exc or StoreError("connection reset by peer")

    def describe(self) -> str:
        return f"counting({self.inner.describe()})"

    def get(self, key: str) -> bytes:
        if key.startswith("shards/"):
            if self.fail_get_after is not None and len(self.gets) >= self.fail_get_after:
                raise self.exc
            data = self.inner.get(key)
            self.gets.append(key)  # counted once it has arrived
            return data
        return self.inner.get(key)

    def put(self, key: str, data: bytes) -> None:
        if key.startswith("shards/"):
            if self.fail_put_after is not None and len(self.puts) >= self.fail_put_after:
                raise self.exc
            self.puts.append(key)
        self.inner.put(key, data)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)


def _two_versions(store, trainer):
    """Publish v0 (anchor) and v1 (delta); return the states and a subscriber at v0."""
    pub = Publisher(store, **OPTS)
    v0 = trainer.step(LR)
    pub.publish(0, v0)
    engine = {k: a.copy() for k, a in v0.items()}
    v1 = trainer.step(LR)
    r1 = pub.publish(1, v1)
    assert r1.payloads[0].shards >= 3
    return v0, v1, engine, Subscriber(store, version=0)


def _delta_shard_keys(store, version: int) -> list[str]:
    m = decode_manifest(store.get(manifest_key(version)), version)
    return [s.key for s in m.parts[0].payload_from(version - 1).shards]


@pytest.mark.parametrize("damage", ["truncate", "bitflip"])
def test_damaged_shard_is_named_and_nothing_applies(
    local_store, big_trainer, same_bits, damage
) -> None:
    v0, v1, engine, sub = _two_versions(local_store, big_trainer)
    key = _delta_shard_keys(local_store, 1)[1]
    path = local_store.path(key)
    good = path.read_bytes()
    bad = good[: len(good) // 2] if damage == "truncate" else bytearray(good)
    if damage == "bitflip":
        bad[len(bad) // 3] ^= 0x10
    path.write_bytes(bytes(bad))
    with pytest.raises(IntegrityError, match=rf"version 1 .*shard 1 \({key}\)"):
        sub.pull(engine)
    same_bits(engine, v0)
    assert sub.version == 0
    path.write_bytes(good)  # the relay re-syncs the shard
    sub.pull(engine)
    same_bits(engine, v1)


def test_missing_manifest(local_store, big_trainer, same_bits) -> None:
    v0, _, engine, sub = _two_versions(local_store, big_trainer)
    with pytest.raises(NotFoundError, match="version 7 has no manifest"):
        sub.prepare(7)
    local_store.path(manifest_key(1)).unlink()  # `latest` says 1, but its manifest is gone
    with pytest.raises(NotFoundError, match="version 1 has no manifest"):
        sub.pull(engine)
    same_bits(engine, v0)


def test_wrong_base_is_refused_and_undone(local_store, big_trainer, same_bits) -> None:
    v0, _, _, _ = _two_versions(local_store, big_trainer)
    pub = Publisher(local_store, **OPTS)
    v2 = big_trainer.step(LR)
    pub.publish(2, v2)
    engine = {k: a.copy() for k, a in v0.items()}  # really at version 0 ...
    sub = Subscriber(local_store, version=1)  # ... but claimed to be at 1
    prepared = sub.prepare()
    assert prepared.path == [(2, 1)]
    with pytest.raises(BaseMismatchError, match="version 2"):
        prepared.apply(engine)
    same_bits(engine, v0)
    assert sub.version == 1


def test_store_unreachable_mid_transfer_then_resume(served, big_trainer, same_bits) -> None:
    origin, http, server = served
    v0, v1, engine, _ = _two_versions(origin, big_trainer)
    keys = _delta_shard_keys(origin, 1)

    class DropsAfterTwo(CountingStore):
        dropped = False

        def get(self, key: str) -> bytes:
            if key.startswith("shards/") and len(self.gets) == 2 and not self.dropped:
                self.dropped = True
                server.stop()  # the relay goes down in the middle of the transfer
            return super().get(key)

    flaky = DropsAfterTwo(http)
    sub = Subscriber(flaky, version=0, download_workers=1)
    with pytest.raises(StoreError, match=r"version 1 \(delta from 0\) shard 2 .*reachable"):
        sub.prepare()
    same_bits(engine, v0)
    assert len(flaky.gets) == 2
    restarted = type(server)(origin.root).start()  # back up (on a new port)
    try:
        flaky.inner = type(http)(restarted.url, retries=0)
        sub.pull(engine)
        assert sorted(flaky.gets) == sorted(keys)  # each shard fetched exactly once
        same_bits(engine, v1)
    finally:
        restarted.stop()


def test_pull_interrupted_halfway_resumes_from_cache_dir(
    local_store, big_trainer, same_bits, tmp_path
) -> None:
    v0, v1, engine, _ = _two_versions(local_store, big_trainer)
    keys = _delta_shard_keys(local_store, 1)
    half = len(keys) // 2
    flaky = CountingStore(local_store, fail_get_after=half)
    sub = Subscriber(flaky, version=0, download_workers=1, cache_dir=tmp_path / "cache")
    with pytest.raises(StoreError, match=rf"version 1 \(delta from 0\) shard {half}"):
        sub.pull(engine)
    same_bits(engine, v0)
    # a new process with the same cache directory downloads only the missing shards
    again = CountingStore(local_store)
    sub2 = Subscriber(again, version=0, cache_dir=tmp_path / "cache")
    report = sub2.pull(engine)
    same_bits(engine, v1)
    assert sorted(again.gets) == sorted(keys[half:])
    assert report.cached_bytes > 0


def test_publisher_killed_between_shards_then_rerun(local_store, big_trainer, same_bits) -> None:
    pub = Publisher(local_store, **OPTS)
    v0 = big_trainer.step(LR)
    pub.publish(0, v0)
    v1 = big_trainer.step(LR)
    dying = CountingStore(local_store, fail_put_after=2, exc=Killed())
    with pytest.raises(Killed):
        Publisher(dying, **OPTS).publish(1, v1)
    assert len(dying.puts) == 2
    # readers still see version 0, complete
    assert Subscriber(local_store).latest() == 0
    same_bits(Subscriber(local_store).materialize(), v0)
    # the restarted trainer publishes the same version: finished shards are not re-sent
    rerun = CountingStore(local_store)
    report = Publisher(rerun, **OPTS).publish(1, v1)
    assert not set(rerun.puts) & set(dying.puts)
    assert sum(p.skipped for p in report.payloads) == 2
    same_bits(Subscriber(local_store).materialize(), v1)


class _FullDisk(io.RawIOBase):
    def __init__(self, budget: list[int]):
        self.budget = budget

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        if self.budget[0] <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.budget[0] -= 1
        return len(b)


def test_disk_full_while_publishing_then_rerun(local_store, big_trainer, monkeypatch, same_bits):
    pub = Publisher(local_store, **OPTS)
    v0 = big_trainer.step(LR)
    pub.publish(0, v0)
    v1 = big_trainer.step(LR)
    real_open = open
    budget = [2]  # two more files fit on the disk

    def tight_open(path, mode="r", *a, **kw):
        if "w" in mode and budget[0] <= 0:
            return _FullDisk(budget)
        if "w" in mode:
            budget[0] -= 1
        return real_open(path, mode, *a, **kw)

    monkeypatch.setattr(local_module, "open", tight_open, raising=False)
    # shards are written in parallel: whichever comes third finds the disk full
    with pytest.raises(StoreError, match=r"version 1 \(delta from 0\): shard \d+ .*disk full"):
        pub.publish(1, v1)
    assert not list(local_store.root.rglob("*.tmp"))  # no half-written files left
    assert Subscriber(local_store).latest() == 0
    monkeypatch.undo()  # space freed
    counting = CountingStore(local_store)
    pub2 = Publisher(counting, **OPTS)
    report = pub2.publish(1, v1)
    assert report.payloads[0].skipped == 2
    same_bits(Subscriber(local_store).materialize(), v1)


def test_disk_full_while_caching_a_pull(local_store, big_trainer, same_bits, tmp_path, monkeypatch):
    v0, _, engine, _ = _two_versions(local_store, big_trainer)
    cache = tmp_path / "cache"
    sub = Subscriber(local_store, version=0, cache_dir=cache)
    from pathlib import Path

    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", full)
    with pytest.raises(StoreError, match=r"version 1 \(delta from 0\) shard \d.*shard cache"):
        sub.pull(engine)
    same_bits(engine, v0)


def test_store_errors_name_the_location(tmp_path) -> None:
    store = LocalStore(tmp_path / "nothing")
    with pytest.raises(NotFoundError, match="not found"):
        store.get(LATEST_KEY)
    with pytest.raises(StoreError, match="invalid store key"):
        store.get("../etc/passwd")
    assert np.isfinite(1.0)


def test_a_second_publisher_on_the_stream_is_refused(local_store, trainer, same_bits) -> None:
    a = Publisher(local_store, **OPTS)
    a.publish(0, trainer.step())
    theirs = trainer.step()
    Publisher(local_store, **OPTS).publish(1, theirs)  # resumes from version 0: allowed
    with pytest.raises(DeltaSyncError, match=r"latest version is 1 .* another publisher"):
        a.publish(2, trainer.step())  # a still believes version 0 is the latest
    # nothing of a's attempt was committed: the stream is the other publisher's
    assert Subscriber(local_store).latest() == 1
    same_bits(Subscriber(local_store).materialize(), theirs)
    mine = trainer.step()
    a.publish(2, mine)  # a rebuilt its base from the store, so it continues the stream
    same_bits(Subscriber(local_store).materialize(), mine)


def test_publishing_an_existing_version_is_refused(local_store, trainer, same_bits) -> None:
    pub = Publisher(local_store, **OPTS)
    pub.publish(0, trainer.step())
    v1 = trainer.step()
    pub.publish(1, v1)
    # a publisher killed after its manifest but before `latest`: version 1 exists, latest is 0
    local_store.put(LATEST_KEY, local_store.get(LATEST_KEY).replace(b'"version":1', b'"version":0'))
    assert Subscriber(local_store).latest() == 0
    fresh = Publisher(local_store, **OPTS)
    with pytest.raises(DeltaSyncError, match="version 1 already exists"):
        fresh.publish(1, trainer.step())
    same_bits(Subscriber(local_store).materialize(1), v1)  # untouched


class FailingCommit(CountingStore):
    """Once armed, the next manifest write fails: the shards are up, the commit is not."""

    armed = False

    def put(self, key: str, data: bytes) -> None:
        if key.endswith("manifest.json") and self.armed:
            self.armed = False
            raise StoreError("connection reset by peer")
        super().put(key, data)


def test_failed_commit_then_publish_again(local_store, trainer, same_bits) -> None:
    store = FailingCommit(local_store)
    pub = Publisher(store, **OPTS)
    v0 = trainer.step()
    engine = {k: a.copy() for k, a in v0.items()}
    pub.publish(0, v0)
    sub = Subscriber(local_store, version=0)
    v1 = trainer.step(LR)
    store.armed = True
    with pytest.raises(StoreError, match="version 1: the shards are uploaded but the commit"):
        pub.publish(1, v1)
    assert sub.latest() == 0
    uploaded = len(store.puts)
    report = pub.publish(1, v1)  # the same publisher finishes the version
    assert report.payloads[0].uploaded == 0  # every shard was already there
    assert len(store.puts) == uploaded
    assert sub.pull(engine).version == 1
    same_bits(engine, v1)


class Outage(Store):
    """Every request fails while `down` is true."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise StoreError("connection refused")

    def get(self, key: str) -> bytes:
        self._check()
        return self.inner.get(key)

    def put(self, key: str, data: bytes) -> None:
        self._check()
        self.inner.put(key, data)

    def exists(self, key: str) -> bool:
        self._check()
        return self.inner.exists(key)

    def describe(self) -> str:
        return f"outage({self.inner.describe()})"


def test_publisher_retries_through_an_outage(local_store, trainer, same_bits) -> None:
    store = Outage(local_store)
    pub = Publisher(store, **OPTS)
    v0 = trainer.step()
    pub.publish(0, v0)
    engine = {k: a.copy() for k, a in v0.items()}
    sub = Subscriber(local_store, version=0)
    store.down = True
    v1, v2 = trainer.step(LR), trainer.step(LR)
    with pytest.raises(StoreError):
        pub.publish(1, v1)
    with pytest.raises(StoreError):  # still down: rebuilding the base from the store fails too
        pub.publish(2, v2)
    store.down = False
    report = pub.publish(2, v2)  # the trainer moved on; version 1 was never published
    assert not report.is_anchor
    assert sub.pull(engine).version == 2
    same_bits(engine, v2)
