"""An emulated wide-area deployment: origin, per-region relays and engines, real links.

A test/benchmark helper (needs root: see `netns.unavailable`). The layout:

    trainer (the caller) writes the origin store directory
    origin ns   the package's HTTP server over that directory, or (`origin="s3"`) moto's S3
                server, which the trainer reaches on the namespace's loopback (`trainer`)
       | uplink: tbf at `uplink_mbit`, shared by every region
    hub ns      one proxy per region adding that region's round trip (and resets on demand)
       | region link: tbf at the region's `rate_mbit`
    region ns   the region's relay (`RelayStore` behind `StoreServer`), if it has one
       | in-region link: tbf at `in_region_mbit`
    engines ns  the region's engines, each a `Subscriber` and a state

Everything runs in this process: each role on threads that entered its namespace
(`setns` is per thread, and threads inherit it), so the emulation starts in well under a
second and its sockets still cross the veth links and their rate limits. Every wait is
bounded, and `close` (also on error, as a context manager) stops every server and
deletes every namespace and link made here.
"""

from __future__ import annotations

import ctypes
import os
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import xxhash

from tandem.delta_sync.dtypes import numpy_dtype
from tandem.delta_sync.errors import DeltaSyncError
from tandem.delta_sync.server import StoreServer
from tandem.delta_sync.stores import HttpStore, LocalStore, RelayStore, S3Store
from tandem.delta_sync.stores.base import Store
from tandem.delta_sync.subscriber import Subscriber
from tandem.delta_sync.testing.netns import Namespaces, sh
from tandem.delta_sync.testing.proxy import Proxy

ORIGIN_PORT, RELAY_PORT, PROXY_PORT = 8080, 8081, 9000
S3_CREDENTIALS = {
    "aws_access_key_id": "wan",
    "aws_secret_access_key": "wan",
    "region_name": "us-east-1",
}
_CLONE_NEWNET = 0x40000000


class RegionSpec(msgspec.Struct, frozen=True):
    name: str
    engines: int = 1
    rate_mbit: float = 200.0
    rtt_ms: float = 100.0
    relay: bool = True
    in_region_mbit: float = 2000.0


class Topology(msgspec.Struct, frozen=True):
    regions: list[RegionSpec]
    uplink_mbit: float = 1000.0


def bits_digest(state: dict[str, Any]) -> str:
    """xxh3-128 over the names and raw bytes of every tensor, in name order: an engine's
    state compared with the trainer's, independently of the manifest's digests."""
    h = xxhash.xxh3_128()
    for name in sorted(state):
        h.update(name.encode())
        h.update(np.ascontiguousarray(state[name]).reshape(-1).view(np.uint8).data)
    return h.hexdigest()


def _enter(ns: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {ns}")
    finally:
        os.close(fd)


def in_ns(ns: str) -> ThreadPoolExecutor:
    """A one-thread executor inside namespace `ns` (threads it starts are there too)."""
    return ThreadPoolExecutor(1, thread_name_prefix=ns, initializer=_enter, initargs=(ns,))


class Engine:
    """An inference engine: a Subscriber and a state, driven from its namespace's thread."""

    def __init__(self, region: int, ns: str, store: Store, workers: int):
        self.region = region
        self.thread = in_ns(ns)
        self.sub = Subscriber(store, workers=workers)
        self.state: dict[str, np.ndarray] | None = None

    def pull(self, version: int | None = None, wait: float = 0.0) -> Future[dict[str, Any]]:
        return self.thread.submit(self._pull, version, wait)

    def _pull(self, version: int | None, wait: float) -> dict[str, Any]:
        t0 = time.perf_counter()
        try:
            prepared = self.sub.prepare(version, wait=wait)
            if self.state is None:  # a fresh engine: empty tensors shaped by the manifest
                infos = prepared.manifest.tensors(None)
                self.state = {n: np.zeros(i.shape, numpy_dtype(i.dtype)) for n, i in infos.items()}
            report = prepared.apply(self.state)
        except DeltaSyncError as e:
            held = None if self.state is None else bits_digest(self.state)
            return {
                "error": str(e),
                "version": self.sub.version,
                "digest": held,
                "region": self.region,
            }
        return {
            "version": report.version,
            "done": time.time(),
            "seconds": time.perf_counter() - t0,
            "prepare_s": report.prepare_seconds,
            "apply_s": report.apply_seconds,
            "downloaded": report.downloaded_bytes,
            "digest": bits_digest(self.state),
            "region": self.region,
        }

    def close(self) -> None:
        self.thread.submit(self.sub.close).result(timeout=30)
        self.thread.shutdown(wait=True)


class Wan:
    """Build the topology and start every role; `pull_all` moves the engines to a version."""

    def __init__(
        self,
        topology: Topology,
        root: Path,
        *,
        engine_workers: int = 1,
        http_timeout: float = 5.0,
        http_retries: int = 3,
        origin: str = "http",
    ) -> None:
        if origin not in ("http", "s3"):
            raise DeltaSyncError(
                f"origin must be 'http' (the package's server over a directory) or 's3' "
                f"(moto's S3 server), got {origin!r}"
            )
        self.origin_kind = origin
        self.bucket = f"wan-{uuid.uuid4().hex[:12]}"
        self.topology = topology
        self.root = Path(root)
        self.origin_dir = self.root / "origin"
        self.engine_workers = engine_workers
        self.http_timeout = http_timeout
        self.http_retries = http_retries
        self.ns: Namespaces | None = None
        self.threads: dict[str, ThreadPoolExecutor] = {}
        self.origin: Any = None  # StoreServer or moto's ThreadedMotoServer
        self.trainer: ThreadPoolExecutor | None = None
        self.proxies: list[Proxy] = []
        self.relays: list[StoreServer | None] = []
        self.engines: list[Engine] = []

    def __enter__(self) -> Wan:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, ns: str, fn: Any, *args: Any) -> Any:
        if ns not in self.threads:
            self.threads[ns] = in_ns(ns)
        return self.threads[ns].submit(fn, *args).result(timeout=30)

    def start(self) -> None:
        self.origin_dir.mkdir(parents=True, exist_ok=True)
        ns = self.ns = Namespaces()
        self.o, self.h = ns.add("o"), ns.add("h")
        ns.fail_fast(self.h)
        self.uplink_dev, _ = ns.link(
            self.o, "10.77.0.1", self.h, "10.77.0.2", self.topology.uplink_mbit * 1e6, None
        )
        self.r: list[str] = []
        self.e: list[str] = []
        self.region_dev: list[str] = []
        for i, spec in enumerate(self.topology.regions):
            r, e = ns.add(f"r{i}"), ns.add(f"e{i}")
            ns.fail_fast(r)
            a, b = f"10.77.{i + 1}.1", f"10.77.{i + 1}.2"
            dev, _ = ns.link(self.h, a, r, b, spec.rate_mbit * 1e6, None)
            ns.link(r, f"10.78.{i + 1}.1", e, f"10.78.{i + 1}.2", spec.in_region_mbit * 1e6, None)
            self.r.append(r)
            self.e.append(e)
            self.region_dev.append(dev)
            ns.route(r, a, forward=True)
            ns.route(e, f"10.78.{i + 1}.1")
            ns.route_to(self.h, f"10.78.{i + 1}.0/30", b)
        self.trainer = self.threads["trainer"] = in_ns(self.o)
        self.start_origin()
        if self.origin_kind == "s3":
            store = self.origin_store()
            assert isinstance(store, S3Store)
            self.trainer.submit(store.client.create_bucket, Bucket=self.bucket).result(timeout=30)
        for i, spec in enumerate(self.topology.regions):
            proxy = Proxy(("10.77.0.1", ORIGIN_PORT), spec.rtt_ms / 1e3)
            self.proxies.append(self._run(self.h, proxy.start, f"10.77.{i + 1}.1", PROXY_PORT + i))
            self.relays.append(self._start_relay(i) if spec.relay else None)
            for _ in range(spec.engines):
                store = self._http(self.relay_url(i)) if spec.relay else self.upstream(i)
                self.engines.append(Engine(i, self.e[i], store, self.engine_workers))

    def proxy_url(self, i: int) -> str:
        return f"http://10.77.{i + 1}.1:{PROXY_PORT + i}"

    def relay_url(self, i: int) -> str:
        return f"http://10.78.{i + 1}.1:{RELAY_PORT}"

    def _http(self, url: str) -> HttpStore:
        return HttpStore(url, timeout=self.http_timeout, retries=self.http_retries, backoff=0.2)

    def upstream(self, i: int) -> Store:
        """The origin as region i reaches it: through the region's proxy and links."""
        if self.origin_kind == "s3":
            return self._s3(self.proxy_url(i))
        return self._http(self.proxy_url(i))

    def origin_store(self) -> Store:
        """The store the trainer publishes to: the origin's directory, or the S3 server on
        the origin namespace's loopback (then call it from `trainer`, a thread there)."""
        if self.origin_kind == "s3":
            return self._s3(f"http://127.0.0.1:{ORIGIN_PORT}")
        return LocalStore(self.origin_dir)

    def _s3(self, endpoint: str) -> S3Store:
        return S3Store(
            self.bucket,
            "run",
            endpoint_url=endpoint,
            retries=self.http_retries + 1,
            connect_timeout=self.http_timeout,
            read_timeout=self.http_timeout,
            **S3_CREDENTIALS,
        )

    def start_origin(self) -> None:
        start = self._start_s3 if self.origin_kind == "s3" else self._start_http
        self.origin = self._run(self.o, start)

    def _start_http(self) -> StoreServer:
        return StoreServer(self.origin_dir, "10.77.0.1", ORIGIN_PORT).start()

    def _start_s3(self) -> Any:
        """moto's S3 server on every address of the origin namespace (its loopback for the
        trainer, its link for the regions); the bucket and its objects outlive a restart
        (moto keeps them in this process), as a bucket does."""
        try:
            from moto.server import ThreadedMotoServer
        except ImportError:
            raise DeltaSyncError(
                "an S3 origin needs moto's server: pip install 'moto[server]'"
            ) from None
        server = ThreadedMotoServer("0.0.0.0", ORIGIN_PORT, verbose=False)
        server.start()
        return server

    def stop_origin(self) -> None:
        """The origin goes away as a failed machine does: its link goes down (transfers in
        flight stall until their timeouts) and its server stops; its directory (or bucket)
        stays."""
        assert self.ns is not None
        self.ns.set_link(self.o, self.uplink_dev, up=False)
        if self.origin is not None:
            self.origin.stop()
            self.origin = None

    def restart_origin(self) -> None:
        assert self.ns is not None
        self.ns.set_link(self.o, self.uplink_dev, up=True)
        self.start_origin()

    def _start_relay(self, i: int) -> StoreServer:
        relay = RelayStore(self.upstream(i), LocalStore(self.root / f"relay{i}"))

        def start() -> StoreServer:
            return StoreServer(relay, f"10.78.{i + 1}.1", RELAY_PORT).start()

        return self._run(self.r[i], start)

    def restart_relay(self, i: int) -> None:
        """Stop region i's relay (it accepts no more requests) and start a new one on the
        same cache directory, as a restarted relay process would come back."""
        old = self.relays[i]
        if old is not None:
            old.stop()
        self.relays[i] = self._start_relay(i)

    def partition(self, i: int, cut: bool) -> None:
        """Cut region i off the hub (the link down), or join it again."""
        assert self.ns is not None
        self.ns.set_link(self.h, self.region_dev[i], up=not cut)
        if not cut:  # the hub's route to the engines went down with its end of the link
            sh(
                "ip",
                "-n",
                self.h,
                "route",
                "replace",
                f"10.78.{i + 1}.0/30",
                "via",
                f"10.77.{i + 1}.2",
            )

    def requests(self, i: int) -> list[dict[str, Any]]:
        """Requests that crossed region i's proxy since the last call (path, bytes, reset)."""
        log = self.proxies[i].log
        out, log[:] = list(log), []
        return out

    def poll(self, timeout: float = 60.0) -> list[int | None]:
        """Every engine asks for `latest` once, as a deployed engine polls between
        versions (which keeps its connections, and its relay's to the origin, open)."""
        futures = [e.thread.submit(e.sub.latest) for e in self.engines]
        return [f.result(timeout=timeout) for f in futures]

    def pull_all(
        self, version: int | None = None, timeout: float = 120.0, regions: list[int] | None = None
    ) -> list[dict[str, Any]]:
        """Every engine (of `regions`, default all) pulls `version` (default latest), all at
        once; their answers, in engine order."""
        chosen = [e for e in self.engines if regions is None or e.region in regions]
        return self.gather([e.pull(version) for e in chosen], timeout)

    def await_next(self, wait: float = 60.0) -> list[Future[dict[str, Any]]]:
        """Every engine waits for the version after its own (a long-poll for its manifest,
        held by its relay and the origin) and pulls it; `gather` their answers."""
        return [e.pull(None, wait) for e in self.engines]

    def gather(self, futures: list[Future[dict[str, Any]]], timeout: float) -> list[dict[str, Any]]:
        """The engines' answers, in order, or an error naming how many did not finish."""
        _done, pending = wait(futures, timeout=timeout)
        if pending:
            raise DeltaSyncError(f"{len(pending)} engines did not finish within {timeout:g} s")
        return [f.result() for f in futures]

    def close(self) -> None:
        for e in self.engines:
            e.close()
        for server in [self.origin, *self.relays]:
            if server is not None:
                server.stop()
        for p in self.proxies:
            p.stop()
        for t in self.threads.values():  # the trainer's thread among them
            t.shutdown(wait=True)
        self.trainer = None
        self.engines, self.proxies, self.relays, self.threads, self.origin = [], [], [], {}, None
        if self.ns is not None:
            self.ns.close()
            self.ns = None
