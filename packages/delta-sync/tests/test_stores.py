"""The three stores on loopback: local files, S3 (moto's server), HTTP (our own server)."""

from __future__ import annotations

import re
import socket
import struct
import threading
import urllib.error
import urllib.request

import pytest

from tandem.delta_sync import (
    HttpStore,
    LocalStore,
    NotFoundError,
    Publisher,
    S3Store,
    StoreError,
    Subscriber,
    open_store,
)
from tandem.delta_sync.server import StoreServer


def _contract(store) -> None:
    assert not store.exists("shards/ab/x.tds")
    with pytest.raises(NotFoundError):
        store.get("shards/ab/x.tds")
    store.put("shards/ab/x.tds", b"one")
    store.put("shards/ab/x.tds", b"two")  # overwrite is whole-object
    assert store.exists("shards/ab/x.tds")
    assert store.get("shards/ab/x.tds") == b"two"
    store.put("empty", b"")
    assert store.get("empty") == b""
    with pytest.raises(StoreError, match="invalid store key"):
        store.put("../escape", b"x")


def test_local_store_contract(local_store) -> None:
    _contract(local_store)


def test_s3_store_contract(s3_store) -> None:
    _contract(s3_store)
    # keys live under the prefix
    objs = s3_store.client.list_objects_v2(Bucket=s3_store.bucket)["Contents"]
    assert {o["Key"] for o in objs} == {"runs/7/shards/ab/x.tds", "runs/7/empty"}


def test_publish_and_pull_through_s3(s3_store, trainer, same_bits) -> None:
    pub = Publisher(s3_store, anchor_every=3, chunk_bytes=1 << 16, shard_bytes=1 << 16)
    engine = None
    for v in range(5):
        state = trainer.step()
        pub.publish(v, state)
        if engine is None:
            engine = {k: a.copy() for k, a in state.items()}
            sub = Subscriber(s3_store, version=0)
        else:
            sub.pull(engine)
        same_bits(engine, state)


def test_s3_unreachable_endpoint_is_a_clear_error() -> None:
    store = S3Store(
        "bucket",
        endpoint_url="http://127.0.0.1:9",  # discard port: nothing listens
        retries=1,
        connect_timeout=1,
        aws_access_key_id="x",
        aws_secret_access_key="x",
        region_name="us-east-1",
    )
    with pytest.raises(StoreError, match=re.escape("s3://bucket/ at http://127.0.0.1:9")):
        store.get("latest")


def test_s3_connection_reset_mid_request_is_a_clear_error() -> None:
    """An endpoint that resets each connection once it has the request (a proxy losing its
    upstream, an origin going away): botocore's error then carries no response."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()

    def reset_each() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(5)
            conn.recv(1 << 16)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()  # RST

    thread = threading.Thread(target=reset_each, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    store = S3Store(
        "bucket",
        endpoint_url=url,
        retries=1,
        aws_access_key_id="x",
        aws_secret_access_key="x",
        region_name="us-east-1",
    )
    try:
        for call in (store.get, store.exists, lambda key: store.put(key, b"x")):
            with pytest.raises(StoreError, match=re.escape(f"s3://bucket/ at {url}")):
                call("latest")
    finally:
        stop.set()
        thread.join(timeout=10)
        listener.close()


def test_http_store_reads_what_the_origin_publishes(served, trainer, same_bits) -> None:
    origin, http, _ = served
    pub = Publisher(origin, chunk_bytes=1 << 16, shard_bytes=1 << 16)
    v0 = trainer.step()
    pub.publish(0, v0)
    engine = {k: a * 0 for k, a in v0.items()}
    sub = Subscriber(http)
    sub.pull(engine)
    same_bits(engine, v0)
    v1 = trainer.step()
    pub.publish(1, v1)
    assert sub.latest() == 1
    sub.pull(engine)
    same_bits(engine, v1)
    assert not http.exists("shards/00/none.tds")
    with pytest.raises(StoreError, match="read-only"):
        http.put("latest", b"x")


def test_server_is_read_only_and_confined_to_its_root(served, tmp_path) -> None:
    origin, http, server = served
    (tmp_path / "secret").write_text("no")
    origin.put("latest", b"{}")
    req = urllib.request.Request(f"{server.url}/latest", data=b"x", method="PUT")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=5)
    assert e.value.code == 405
    for path in ("/../secret", "/%2e%2e/secret", "/versions/../../secret"):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"{server.url}{path}", timeout=5)
        assert e.value.code == 404
    assert http.get("latest") == b"{}"


def test_open_store_understands_urls(tmp_path) -> None:
    assert isinstance(open_store(str(tmp_path)), LocalStore)
    assert isinstance(open_store(f"file://{tmp_path}"), LocalStore)
    assert isinstance(open_store("http://127.0.0.1:1/x"), HttpStore)
    s3 = open_store("s3://bucket/a/b", endpoint_url="http://127.0.0.1:1")
    assert isinstance(s3, S3Store) and s3.bucket == "bucket" and s3.prefix == "a/b"


def test_http_store_keeps_connections_alive_and_outlives_a_server_restart(tmp_path) -> None:
    LocalStore(tmp_path).put("shards/ab/x.tds", b"x" * 5000)
    accepted: list[int] = []

    def counting(server: StoreServer) -> StoreServer:
        serve = server.httpd.process_request
        server.httpd.process_request = lambda *a: (accepted.append(1), serve(*a))[1]  # type: ignore[method-assign]
        return server.start()

    server = counting(StoreServer(tmp_path))
    port = server.httpd.server_address[1]
    store = HttpStore(server.url, retries=0)
    try:
        for _ in range(5):
            assert store.get("shards/ab/x.tds") == b"x" * 5000
        assert store.exists("shards/ab/x.tds") and not store.exists("shards/ab/y.tds")
        assert len(accepted) == 1  # seven requests, one connection
        server.stop()  # its kept-alive connection is closed with it
        server = counting(StoreServer(tmp_path, port=port))
        assert store.get("shards/ab/x.tds") == b"x" * 5000  # no retry left: reconnected
        assert len(accepted) == 2
    finally:
        store.close()
        server.stop()
