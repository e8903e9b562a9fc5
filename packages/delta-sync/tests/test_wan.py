"""Relays, resets, slow links and faults over an emulated WAN (network namespaces, tbf, a
round-trip proxy). Needs root; skipped elsewhere. One deployment serves the whole module:

    near: a relay, 2 engines, 400 Mbit/s, 40 ms round trip
    far:  a relay, 1 engine,    2 Mbit/s, 150 ms round trip      (uplink 1 Gbit/s)

Every engine's state is checked against the publisher's arrays by a digest of the raw
bytes computed here (not the manifest's digests).
"""

from __future__ import annotations

import socket
import time
from collections import Counter
from collections.abc import Iterator

import ml_dtypes
import numpy as np
import pytest

from tandem.delta_sync import LocalStore, Publisher, warm_up
from tandem.delta_sync.testing import netns
from tandem.delta_sync.testing.wan import RegionSpec, Topology, Wan, bits_digest, in_ns

pytestmark = pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable()))

NEAR, FAR = 0, 1
TOPOLOGY = Topology(
    [
        RegionSpec("near", engines=2, rate_mbit=400, rtt_ms=40),
        RegionSpec("far", engines=1, rate_mbit=2, rtt_ms=150),
    ],
    uplink_mbit=1000,
)


class Stream:
    """The trainer: a bf16 state of 512K weights (1 MB), published after every change."""

    def __init__(self, wan: Wan) -> None:
        self.rng = np.random.default_rng(5)
        self.state = {"w": (self.rng.standard_normal(1 << 19) * 0.02).astype(ml_dtypes.bfloat16)}
        self.pub = Publisher(
            LocalStore(wan.origin_dir), anchor_every=4, shard_bytes=64 << 10, chunk_bytes=64 << 10
        )
        self.version = -1
        self.digests: dict[int, str] = {}

    def step(self, changed: float, fresh: bool = False) -> int:
        """Move `changed` of the weights by one ulp (`fresh`: draw them all anew) and
        publish; returns the version."""
        if fresh:
            self.state["w"][:] = self.rng.standard_normal(1 << 19) * 0.02
        elif self.version >= 0:
            bits = self.state["w"].view(np.uint16)
            bits[self.rng.random(bits.size) < changed] += np.uint16(1)
        self.version += 1
        self.pub.publish(self.version, self.state)
        self.digests[self.version] = bits_digest(self.state)
        return self.version


@pytest.fixture(scope="module")
def wan(tmp_path_factory) -> Iterator[tuple[Wan, Stream]]:
    warm_up((2,))
    with Wan(TOPOLOGY, tmp_path_factory.mktemp("wan"), http_timeout=5.0, http_retries=1) as w:
        stream = Stream(w)
        try:
            yield w, stream
        finally:
            stream.pub.close()


def pull(w: Wan, stream: Stream, regions: list[int] | None = None) -> list[dict]:
    results = w.pull_all(timeout=60, regions=regions)
    for r in results:
        assert "error" not in r, r
        assert r["version"] == stream.version
        assert r["digest"] == stream.digests[stream.version], "engine state is not bit-exact"
    return results


def shard_gets(w: Wan, region: int) -> Counter:
    return Counter(r["path"] for r in w.requests(region) if "/shards/" in r["path"])


def congestion_control(ns: str) -> str:
    """The algorithm a new TCP socket opened in namespace `ns` gets."""

    def probe() -> str:
        with socket.socket() as s:
            raw = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16)
        return raw.split(b"\0", 1)[0].decode()

    with in_ns(ns) as thread:
        return thread.submit(probe).result(timeout=10)


def test_every_namespace_uses_the_pinned_congestion_control(wan) -> None:
    """TCP in the emulation sees sub-millisecond round trips (the proxy adds them above
    it), so the algorithm must not be whatever the host defaults to (see `netns`)."""
    w, _ = wan
    for ns in [w.o, w.h, *w.r, *w.e]:
        assert congestion_control(ns) == netns.CC == "reno", ns


def test_a_relay_per_region_takes_each_shard_from_the_origin_once(wan) -> None:
    w, stream = wan
    stream.step(0.0)  # the anchor
    pull(w, stream)
    stream.step(0.3)
    pull(w, stream)
    for region in (NEAR, FAR):
        gets = shard_gets(w, region)
        assert len(gets) > 5  # the anchor spans many shards
        assert set(gets.values()) == {1}, gets  # near's two engines cost one fetch each


def test_a_reset_mid_shard_resumes_without_resending_finished_shards(wan) -> None:
    w, stream = wan
    w.requests(NEAR)
    stream.step(0.0, fresh=True)  # a delta of many shards
    w.proxies[NEAR].reset_next(after_bytes=20_000)
    pull(w, stream, regions=[NEAR])
    log = [r for r in w.requests(NEAR) if "/shards/" in r["path"]]
    resets = [r for r in log if r["reset"]]
    assert len(resets) == 1 and resets[0]["bytes"] == 20_000
    gets = Counter(r["path"] for r in log)
    assert len(gets) > 5
    assert gets[resets[0]["path"]] == 2  # the cut shard again, whole
    assert all(n == 1 for p, n in gets.items() if p != resets[0]["path"])  # no other again
    pull(w, stream, regions=[FAR])  # catch far up for the next test


def test_a_slow_region_does_not_delay_the_others(wan) -> None:
    w, stream = wan
    stream.step(0.0, fresh=True)  # ~0.75 MB: 3 s on far's 2 Mbit/s link, 0.015 s on near's
    t0 = time.time()
    results = pull(w, stream)
    near = max(r["done"] for r in results if r["region"] == NEAR) - t0
    far = max(r["done"] for r in results if r["region"] == FAR) - t0
    wire = next(r["downloaded"] for r in results if r["region"] == FAR) * 8 / 2e6
    assert far > wire > 2, (far, wire)  # far's link really is 2 Mbit/s
    assert near < far / 2, (near, far)  # near's engines did not wait for far's


def test_a_relay_restarted_mid_pull_loses_nothing(wan) -> None:
    w, stream = wan
    before = stream.version
    stream.step(0.0, fresh=True)
    w.requests(FAR)
    engine = next(e for e in w.engines if e.region == FAR)
    cache = w.root / f"relay{FAR}"
    earlier = cached_shards(cache)
    pulling = engine.pull()
    deadline = time.monotonic() + 20
    while not cached_shards(cache) - earlier and time.monotonic() < deadline:
        time.sleep(0.005)
    cached = cached_shards(cache) - earlier  # finished: in the relay's cache; others are not
    assert cached, "no shard of the new version reached the relay's cache within 20 s"
    w.restart_relay(FAR)
    first = pulling.result(timeout=60)
    if "error" in first:  # the pull failed: the engine still holds the previous version
        assert first["version"] == before and first["digest"] == stream.digests[before]
    pull(w, stream, regions=[FAR])
    gets = shard_gets(w, FAR)  # every origin fetch since before the first pull
    again = {p: gets[p] for p in cached if gets[p] != 1}
    assert not again, again  # the relay's cache survived: no finished shard fetched twice


def cached_shards(cache) -> set[str]:
    """The request paths of the shards in a relay's cache directory."""
    return {"/" + p.relative_to(cache).as_posix() for p in cache.glob("shards/*/*.tds")}


def test_a_partitioned_region_catches_up_after_it_rejoins(wan) -> None:
    w, stream = wan
    pull(w, stream)  # everyone on the same version
    held = stream.version
    w.partition(FAR, cut=True)
    try:
        for _ in range(5):  # crosses an anchor (anchor_every=4)
            stream.step(0.05)
        results = w.pull_all(timeout=60, regions=[FAR])
        for r in results:
            assert "error" in r and r["version"] == held and r["digest"] == stream.digests[held]
        pull(w, stream, regions=[NEAR])  # the others go on
    finally:
        w.partition(FAR, cut=False)
    pull(w, stream, regions=[FAR])  # from its version: anchor + catch-up, or the chain


def test_the_origin_going_away_mid_pull_leaves_the_previous_version(wan) -> None:
    w, stream = wan
    held = stream.version
    stream.step(0.0, fresh=True)
    w.requests(FAR)
    started = w.proxies[FAR].started
    started.clear()
    pulling = [e.pull() for e in w.engines if e.region == FAR]
    deadline = time.monotonic() + 20
    while not any("/shards/" in p for p in started) and time.monotonic() < deadline:
        time.sleep(0.005)
    w.stop_origin()  # the first shards are on their way (a 3 s transfer), the rest are not
    try:
        for r in (f.result(timeout=60) for f in pulling):
            assert "error" in r, "the pull finished although the origin went away midway"
            assert r["version"] == held and r["digest"] == stream.digests[held]
    finally:
        w.restart_origin()
    pull(w, stream)
