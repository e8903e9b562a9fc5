"""A subscriber waits for the next version with a long-poll for its manifest: the HTTP
server (and a relay in front of it) holds the request until the publisher commits, so the
subscriber has it half a round trip after the commit instead of on its next poll."""

from __future__ import annotations

import threading
import time

import pytest

from tandem.delta_sync import LocalStore, NotFoundError, Publisher, Subscriber
from tandem.delta_sync.server import StoreServer
from tandem.delta_sync.stores import HttpStore, RelayStore


def later(seconds: float, fn) -> threading.Thread:
    t = threading.Timer(seconds, fn)
    t.start()
    return t


def test_a_held_get_is_answered_when_the_object_appears_and_404s_after_its_wait(served) -> None:
    origin, http, _ = served
    t = later(0.3, lambda: origin.put("a/b", b"payload"))
    t0 = time.monotonic()
    assert http.get_wait("a/b", 5.0) == b"payload"
    assert 0.25 < time.monotonic() - t0 < 2.0  # answered as it appeared, not after 5 s
    t.join()
    t0 = time.monotonic()
    with pytest.raises(NotFoundError, match=r"waited 0\.3 s"):
        http.get_wait("a/missing", 0.3)
    assert 0.25 < time.monotonic() - t0 < 2.0


def test_a_relay_passes_the_wait_to_its_origin(served, tmp_path) -> None:
    origin, http, _ = served
    relay = StoreServer(RelayStore(http, LocalStore(tmp_path / "cache"))).start()
    try:
        through = HttpStore(relay.url, retries=1, timeout=10)
        t = later(0.3, lambda: origin.put("versions/000000000001/x", b"x"))
        assert through.get_wait("versions/000000000001/x", 5.0) == b"x"
        t.join()
    finally:
        relay.stop()


def test_a_subscriber_waiting_gets_the_next_version_once_published(
    served, trainer, same_bits
) -> None:
    origin, http, _ = served
    pub = Publisher(origin, shard_bytes=64 << 10, chunk_bytes=64 << 10)
    v0 = trainer.snapshot()
    pub.publish(0, v0)
    state = {k: a.copy() for k, a in v0.items()}
    v1 = trainer.step()
    patient = HttpStore(http.base_url, retries=1, timeout=120)  # holds a 60 s long-poll
    with pub, Subscriber(patient, version=0) as sub:
        quiet = sub.pull(state, wait=0.2)  # nothing newer within the wait: nothing to do
        assert quiet.version == 0 and quiet.downloaded_bytes == 0
        t = later(0.3, lambda: pub.publish(1, v1))
        report = sub.pull(state, wait=60.0)  # one held request, however long publish takes
        assert report.version == 1
        t.join()
    same_bits(state, v1)
