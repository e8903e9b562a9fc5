"""Publishing a stream of versions and pulling it: paths, anchors, catch-up, two phases."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.delta_sync import (
    DeltaSyncError,
    LocalStore,
    NotFoundError,
    Publisher,
    Subscriber,
)
from tandem.delta_sync.manifest import LATEST_KEY, decode_manifest, manifest_key

SMALL = {"chunk_bytes": 1 << 16, "shard_bytes": 1 << 17}


def _zeros_like(state: dict) -> dict:
    return {k: np.zeros_like(v) for k, v in state.items()}


def test_every_pull_is_bit_exact_over_a_stream(local_store, trainer, same_bits) -> None:
    pub = Publisher(local_store, anchor_every=3, **SMALL)
    engine = _zeros_like(trainer.snapshot())
    sub = Subscriber(local_store)
    history = {}
    for v in range(8):
        history[v] = trainer.step()
        report = pub.publish(v, history[v])
        assert report.is_anchor == (v % 3 == 0)
        if v in (0, 1, 2, 5, 7):
            pull = sub.pull(engine)
            assert pull.version == v
            same_bits(engine, history[v])
    # an old version can still be rebuilt from its own anchor
    same_bits(Subscriber(local_store).materialize(4), history[4])


def test_one_version_behind_downloads_only_the_step_delta(local_store, trainer) -> None:
    pub = Publisher(local_store, anchor_every=25, **SMALL)
    engine = _zeros_like(trainer.snapshot())
    sub = Subscriber(local_store)
    pub.publish(0, trainer.step())
    sub.pull(engine)
    pub.publish(1, trainer.step())
    r2 = pub.publish(2, trainer.step())
    sub.pull(engine, version=1)
    prepared = sub.prepare()
    assert prepared.path == [(2, 1)]
    assert prepared.downloaded_bytes == r2.step_bytes
    dense = r2.dense_bytes
    assert prepared.downloaded_bytes * 10 < dense


def test_far_behind_reader_takes_anchor_plus_one_catch_up_delta(local_store, trainer) -> None:
    pub = Publisher(local_store, anchor_every=5, **SMALL)
    reports = {v: pub.publish(v, trainer.step()) for v in range(13)}
    sub = Subscriber(local_store, version=None)
    prepared = sub.prepare()
    assert prepared.path == [(10, None), (12, 10)]  # anchor 10 + catch-up 10 -> 12
    anchor_bytes = reports[10].payloads[0].nbytes
    catchup = next(p for p in reports[12].payloads if p.base_version == 10).nbytes
    assert prepared.downloaded_bytes == anchor_bytes + catchup
    # a reader at version 3 (previous epoch) must not walk a long chain of deltas
    state = Subscriber(local_store).materialize(3)
    sub3 = Subscriber(local_store, version=3)
    p3 = sub3.prepare()
    assert len(p3.path) <= sub3.max_chain
    assert p3.downloaded_bytes <= anchor_bytes + catchup
    report = p3.apply(state)
    assert report.version == 12


def test_stream_without_catch_up_deltas_is_pulled_through_step_deltas(
    local_store, trainer, same_bits
) -> None:
    pub = Publisher(local_store, anchor_every=4, catchup=False, **SMALL)
    history = {v: trainer.step() for v in range(7)}
    for v, state in history.items():
        pub.publish(v, state)
    # every version carries only its step delta (and the anchors their full payload)
    assert Subscriber(local_store).manifest(6).bases() == {5}
    fresh = Subscriber(local_store, version=None).prepare()
    assert fresh.path == [(4, None), (5, 4), (6, 5)]
    same_bits(Subscriber(local_store).materialize(6), history[6])
    same_bits(Subscriber(local_store).materialize(2), history[2])
    behind = Subscriber(local_store, version=3)
    state = {k: a.copy() for k, a in history[3].items()}
    assert behind.pull(state).version == 6
    same_bits(state, history[6])


def test_catch_up_delta_is_smaller_than_the_chain_it_replaces(local_store, trainer) -> None:
    pub = Publisher(local_store, anchor_every=100, **SMALL)
    reports = [pub.publish(v, trainer.step()) for v in range(6)]
    catchup = next(p for p in reports[5].payloads if p.base_version == 0)
    chain = sum(r.step_bytes for r in reports[1:])
    assert catchup.nbytes < chain
    sub = Subscriber(local_store, version=0)
    assert sub.prepare().path == [(5, 0)]


def test_two_phase_apply_reports_both_times_and_prepare_touches_nothing(
    local_store, trainer, same_bits
) -> None:
    pub = Publisher(local_store, **SMALL)
    v0 = trainer.step()
    pub.publish(0, v0)
    engine = {k: a.copy() for k, a in v0.items()}
    sub = Subscriber(local_store, version=0)
    v1 = trainer.step()
    pub.publish(1, v1)
    prepared = sub.prepare()
    same_bits(engine, v0)  # still serving version 0
    assert sub.version == 0
    report = prepared.apply(engine)
    same_bits(engine, v1)
    assert sub.version == 1
    assert report.prepare_seconds > 0 and report.apply_seconds > 0
    assert report.changed == sum(
        int((v0[k].view(np.uint16) != v1[k].view(np.uint16)).sum()) for k in v0
    )
    # applying a stale Prepared again is refused
    with pytest.raises(DeltaSyncError, match="prepare again"):
        prepared.apply(engine)


def test_publishing_an_existing_or_older_version_is_an_error(local_store, trainer) -> None:
    pub = Publisher(local_store, **SMALL)
    pub.publish(5, trainer.step())
    for v in (5, 4):
        with pytest.raises(DeltaSyncError, match="strictly increase"):
            pub.publish(v, trainer.step())
    with pytest.raises(DeltaSyncError, match=r"already published|strictly"):
        Publisher(local_store, **SMALL).publish(5, trainer.step())


def test_manifest_is_the_commit_and_latest_comes_last(local_store, trainer, monkeypatch) -> None:
    pub = Publisher(local_store, **SMALL)
    pub.publish(0, trainer.step())
    writes: list[str] = []
    original = LocalStore.put

    def recording_put(self, key, data):
        writes.append(key)
        return original(self, key, data)

    monkeypatch.setattr(LocalStore, "put", recording_put)
    pub.publish(1, trainer.step())
    assert writes[-2:] == [manifest_key(1), LATEST_KEY]
    assert all(k.startswith("shards/") for k in writes[:-2])
    m = decode_manifest(local_store.get(manifest_key(1)), 1)
    keys = {s.key for part in m.parts for p in part.payloads for s in p.shards}
    assert keys <= set(writes)
    assert all(local_store.exists(k) for k in keys)


def test_restarted_publisher_continues_the_stream(local_store, trainer, same_bits) -> None:
    Publisher(local_store, anchor_every=4, **SMALL).publish(0, trainer.step())
    Publisher(local_store, anchor_every=4, **SMALL).publish(1, trainer.step())
    pub = Publisher(local_store, anchor_every=4, **SMALL)
    v2 = trainer.step()
    report = pub.publish(2, v2)
    assert not report.is_anchor
    assert {p.base_version for p in report.payloads} == {1, 0}
    same_bits(Subscriber(local_store).materialize(), v2)


def test_layout_change_is_refused(local_store, trainer) -> None:
    pub = Publisher(local_store, **SMALL)
    state = trainer.step()
    pub.publish(0, state)
    with pytest.raises(DeltaSyncError, match="changed from"):
        pub.publish(1, {**state, "embed": state["embed"][:10].copy()})


def test_nothing_published_yet(local_store) -> None:
    with pytest.raises(NotFoundError, match="nothing has been published"):
        Subscriber(local_store).prepare()
    assert Subscriber(local_store).latest() is None


def test_engine_state_with_extra_buffers_is_fine(local_store, trainer, same_bits) -> None:
    pub = Publisher(local_store, **SMALL)
    v0 = trainer.step()
    pub.publish(0, v0)
    engine = {**_zeros_like(v0), "rope.cache": np.ones(7, np.float32)}
    Subscriber(local_store).pull(engine)
    same_bits({k: engine[k] for k in v0}, v0)
    assert np.all(engine["rope.cache"] == 1)


def test_worker_threads_are_kept_across_versions_and_stop_on_close(
    local_store, trainer, same_bits
) -> None:
    import threading

    def ours() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("delta-sync-")}

    before = ours()
    engine = _zeros_like(trainer.snapshot())
    with Publisher(local_store, **SMALL) as pub, Subscriber(local_store) as sub:
        pub.publish(0, trainer.step())
        sub.pull(engine)
        started = ours() - before
        assert started  # the pools are running
        state = trainer.step()
        pub.publish(1, state)
        sub.pull(engine)
        assert started <= ours()  # still running: the next version did not start them anew
        same_bits(engine, state)
    assert ours() - before == set()
