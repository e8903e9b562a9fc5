"""Staging decodes each shard as its download finishes, and stops every download when it fails."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import tandem.delta_sync.codec.patch as patch_module
from tandem.delta_sync import LocalStore, Publisher, Subscriber
from tandem.delta_sync.manifest import decode_manifest, manifest_key

SMALL = {"chunk_bytes": 1 << 16, "shard_bytes": 1 << 16}


class HeldStore(LocalStore):
    """A local store that holds the `held` shards' reads until `release` is set (or `hold_s`
    passes, which is recorded), and counts the reads in flight."""

    def __init__(self, root, held: set[str], release: threading.Event, hold_s: float) -> None:
        super().__init__(root)
        self.held, self.release, self.hold_s = held, release, hold_s
        self.in_flight = 0
        self.timed_out: list[str] = []
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes:
        with self._lock:
            self.in_flight += 1
        try:
            if key in self.held and not self.release.wait(self.hold_s):
                self.timed_out.append(key)
            return super().get(key)
        finally:
            with self._lock:
                self.in_flight -= 1


def _delta_shards(store: LocalStore, version: int) -> list[str]:
    m = decode_manifest(store.get(manifest_key(version)), version)
    payload = m.parts[0].payload_from(version - 1)
    assert payload is not None
    return [ref.key for ref in payload.shards]


def _published(root, big_trainer) -> tuple[dict, dict]:
    pub = Publisher(LocalStore(root), anchor_every=100, **SMALL)
    v0 = big_trainer.step()
    pub.publish(0, v0)
    v1 = big_trainer.step(lr=2e-5)
    pub.publish(1, v1)
    pub.close()
    return v0, v1


def test_a_shard_is_decoded_before_the_last_one_arrives(
    tmp_path, big_trainer, same_bits, monkeypatch
) -> None:
    v0, v1 = _published(tmp_path / "store", big_trainer)
    keys = _delta_shards(LocalStore(tmp_path / "store"), 1)
    assert len(keys) >= 3, "the delta should span several shards"
    decoded = threading.Event()
    real = patch_module.decompress_sparse

    def decompress(*args, **kwargs):
        decoded.set()
        return real(*args, **kwargs)

    monkeypatch.setattr(patch_module, "decompress_sparse", decompress)
    # the last shard's read waits until some chunk has been decoded: only staging that
    # decodes shards as they arrive releases it; staging after every download waits it out
    store = HeldStore(tmp_path / "store", {keys[-1]}, decoded, hold_s=10.0)
    engine = {k: a.copy() for k, a in v0.items()}
    with Subscriber(store, version=0, workers=1) as sub:
        report = sub.pull(engine)
    assert report.version == 1
    assert store.timed_out == []
    same_bits(engine, v1)


def test_a_failed_staging_leaves_no_download_running(tmp_path, big_trainer) -> None:
    v0, _ = _published(tmp_path / "store", big_trainer)
    keys = _delta_shards(LocalStore(tmp_path / "store"), 1)
    never = threading.Event()
    store = HeldStore(tmp_path / "store", set(keys[1:]), never, hold_s=0.5)

    def progress(phase: str, nbytes: int) -> None:
        raise RuntimeError("the engine gave up")

    engine = {k: a.copy() for k, a in v0.items()}
    before = {k: a.copy() for k, a in engine.items()}
    sub = Subscriber(store, version=0, workers=1, download_workers=4, progress=progress)
    with pytest.raises(RuntimeError, match="gave up") as failed:
        sub.prepare()
    # the first shard arrived and failed; the later ones were held: waited for before the
    # error left `prepare`, not when the error (whose traceback holds its frames) is freed
    assert store.in_flight == 0
    assert store.timed_out, "no held read had started"
    assert failed.traceback  # kept alive until here
    assert sub.version == 0
    assert all(np.array_equal(engine[k], before[k]) for k in engine)
    sub.close()
