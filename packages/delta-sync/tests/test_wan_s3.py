"""An S3 origin (moto's server) in the emulated WAN: the trainer publishes to it on the
origin namespace's loopback, a relay region and a relay-less region read it through their
links. Needs root; skipped elsewhere.

    near: a relay, 1 engine, 400 Mbit/s, 40 ms round trip
    far:  no relay, 1 engine, 100 Mbit/s, 120 ms round trip      (uplink 1 Gbit/s)
"""

from __future__ import annotations

from collections.abc import Iterator

import ml_dtypes
import numpy as np
import pytest

from tandem.delta_sync import Publisher, warm_up
from tandem.delta_sync.errors import StoreError
from tandem.delta_sync.reports import PublishReport
from tandem.delta_sync.testing import netns
from tandem.delta_sync.testing.wan import RegionSpec, Topology, Wan, bits_digest

pytestmark = pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable()))
pytest.importorskip("moto.server")

NEAR, FAR = 0, 1
TOPOLOGY = Topology(
    [
        RegionSpec("near", engines=1, rate_mbit=400, rtt_ms=40),
        RegionSpec("far", engines=1, rate_mbit=100, rtt_ms=120, relay=False),
    ],
    uplink_mbit=1000,
)


class Trainer:
    """A 1 MB bf16 state published to the S3 origin from a thread in its namespace; a
    progress hook can take the origin away midway through a publish."""

    def __init__(self, wan: Wan) -> None:
        self.wan = wan
        self.rng = np.random.default_rng(11)
        self.state = {"w": (self.rng.standard_normal(1 << 19) * 0.02).astype(ml_dtypes.bfloat16)}
        self.cut_at: int | None = None  # take the origin away at this many shards handed over
        self.uploads = 0
        self.pub = self.call(
            Publisher,
            wan.origin_store(),
            anchor_every=4,
            shard_bytes=64 << 10,
            chunk_bytes=64 << 10,
            upload_workers=1,
            progress=self.progress,
        )
        self.version = -1
        self.digests: dict[int, str] = {}

    def call(self, fn, *args, **kwargs):
        assert self.wan.trainer is not None
        return self.wan.trainer.submit(fn, *args, **kwargs).result(timeout=120)

    def progress(self, phase: str, nbytes: int) -> None:
        if phase != "upload":
            return
        self.uploads += 1
        if self.uploads == self.cut_at:
            self.wan.stop_origin()

    def change(self, fresh: bool = False) -> None:
        if fresh:
            self.state["w"][:] = self.rng.standard_normal(1 << 19) * 0.02
        else:
            bits = self.state["w"].view(np.uint16)
            bits[self.rng.random(bits.size) < 0.05] += np.uint16(1)

    def publish(self) -> PublishReport:
        report = self.call(self.pub.publish, self.version + 1, self.state)
        self.version += 1
        self.digests[self.version] = bits_digest(self.state)
        return report


@pytest.fixture(scope="module")
def wan(tmp_path_factory) -> Iterator[tuple[Wan, Trainer]]:
    warm_up((2,))
    with Wan(
        TOPOLOGY, tmp_path_factory.mktemp("wan-s3"), http_timeout=5.0, http_retries=1, origin="s3"
    ) as w:
        trainer = Trainer(w)
        try:
            yield w, trainer
        finally:
            trainer.call(trainer.pub.close)


def pull_all(w: Wan, trainer: Trainer) -> None:
    for r in w.pull_all(timeout=60):
        assert "error" not in r, r
        assert r["version"] == trainer.version
        assert r["digest"] == trainer.digests[trainer.version], "engine state is not bit-exact"


def test_both_regions_pull_from_the_s3_origin_through_their_links(wan) -> None:
    w, trainer = wan
    trainer.publish()  # the anchor
    pull_all(w, trainer)
    trainer.change()
    trainer.publish()
    pull_all(w, trainer)
    for region in (NEAR, FAR):
        gets = [r["path"] for r in w.requests(region) if "/shards/" in r["path"]]
        assert len(gets) > 5, gets  # the anchor spans many shards, each read over S3
        assert all(p.startswith(f"/{w.bucket}/run/shards/") for p in gets), gets
        assert len(set(gets)) == len(gets)  # one engine each: every shard read once


def test_the_origin_going_away_mid_publish_leaves_the_previous_version(wan) -> None:
    w, trainer = wan
    if trainer.version < 0:  # run on its own: a version for the engines to hold first
        trainer.publish()
        pull_all(w, trainer)
    held = trainer.version
    trainer.change(fresh=True)  # a version of many new shards
    # one upload in flight at a time: when the third shard is handed over, two are stored
    trainer.cut_at = trainer.uploads + 3
    try:
        with pytest.raises(StoreError, match="previous version is intact"):
            trainer.publish()
        assert trainer.version == held
        for r in w.pull_all(timeout=60):  # the engines cannot reach it either: nothing changes
            assert "error" in r, r
            assert r["version"] == held and r["digest"] == trainer.digests[held]
    finally:
        w.restart_origin()
    pull_all(w, trainer)  # the origin back: still the previous version, whole
    assert w.engines[0].sub.version == held
    report = trainer.publish()  # published again: the shards already there are not sent again
    step = report.payloads[0]
    assert step.skipped >= 2 and step.uploaded + step.skipped == step.shards > 5, step
    pull_all(w, trainer)
