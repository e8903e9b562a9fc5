"""`delta-sync`: publish, pull, inspect, serve, relay and bench from the command line.

    delta-sync publish STORE model.safetensors --version 7
    delta-sync pull STORE --out model.safetensors          # rebuild the latest version
    delta-sync pull s3://bucket/run --mirror /srv/relay    # copy it into a relay directory
    delta-sync inspect STORE [--version 7] [--json]
    delta-sync serve /srv/relay --port 8080                # read-only HTTP for a directory
    delta-sync relay s3://bucket/run --cache /srv/cache    # per-region read-through cache
    delta-sync bench --mb 256

STORE is a directory, file://DIR, s3://BUCKET/PREFIX or http(s)://HOST/PATH.
"""

from __future__ import annotations

import argparse
import logging
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import structlog
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from tandem.delta_sync import safetensors_io
from tandem.delta_sync.dtypes import itemsize
from tandem.delta_sync.errors import DeltaSyncError
from tandem.delta_sync.manifest import LATEST_KEY, manifest_key
from tandem.delta_sync.parallel import default_workers
from tandem.delta_sync.stores import LocalStore, open_store
from tandem.delta_sync.subscriber import Subscriber

console = Console(stderr=True)


@contextmanager
def transfer_progress(total: int, phases: tuple[str, ...]):
    """A rich progress bar per phase; yields a callback (phase, nbytes)."""
    with Progress(
        TextColumn("{task.description:>8}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    ) as bar:
        # a publish encodes one pass per payload and uploads an unknown number of bytes
        sized = ("download", "mirror")
        tasks = {p: bar.add_task(p, total=total if p in sized else None) for p in phases}
        yield lambda phase, n: bar.advance(tasks[phase], n) if phase in tasks else None


def load_state(path: str) -> dict[str, np.ndarray]:
    if path.endswith(".safetensors"):
        return safetensors_io.load(path)
    if path.endswith(".npz"):
        with np.load(path) as z:
            return {k: z[k] for k in z.files}
    raise DeltaSyncError(f"{path}: expected a .safetensors or .npz file")


def cmd_publish(args: argparse.Namespace) -> int:
    from tandem.delta_sync.publisher import Publisher

    state = load_state(args.file)
    total = sum(a.nbytes for a in state.values())
    store = open_store(args.store)
    with transfer_progress(total, ("encode", "upload")) as progress:
        pub = Publisher(
            store,
            anchor_every=args.anchor_every,
            shard_bytes=args.shard_mb << 20,
            chunk_bytes=args.chunk_mb << 20,
            workers=args.workers,
            progress=progress,
        )
        report = pub.publish(args.version, state)
    kind = "anchor" if report.is_anchor else "delta"
    console.print(
        f"published version {report.version} ({kind}): {report.step_bytes:,} bytes for "
        f"{report.dense_bytes:,} dense ({report.ratio:.1f}x) in {report.seconds:.2f} s"
    )
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    store = open_store(args.store)
    sub = Subscriber(store, workers=args.workers)
    target = sub.latest() if args.version is None else args.version
    if target is None:
        raise DeltaSyncError(f"nothing has been published to {store.describe()} yet")
    path = sub.plan(target, None)
    keys = [
        ref
        for v, base in path
        for part in sub.manifest(v).parts
        for ref in part.payload_from(base).shards  # type: ignore[union-attr]
    ]
    total = sum(r.nbytes for r in keys)
    if args.mirror:
        dest = open_store(args.mirror)
        with transfer_progress(total, ("mirror",)) as progress:
            for ref in keys:
                if not dest.exists(ref.key):
                    dest.put(ref.key, store.get(ref.key))
                progress("mirror", ref.nbytes)
        for v, _ in path:
            dest.put(manifest_key(v), store.get(manifest_key(v)))
        if args.version is None:
            dest.put(LATEST_KEY, store.get(LATEST_KEY))
        console.print(f"mirrored version {target} into {dest.describe()} ({total:,} bytes)")
    if args.out:
        with transfer_progress(total, ("download",)) as progress:
            sub.progress = progress
            arrays = sub.materialize(target)
        safetensors_io.save(args.out, arrays)
        console.print(f"wrote version {target} ({len(arrays)} tensors) to {args.out}")
    if not args.mirror and not args.out:
        sub.materialize(target)
        console.print(f"version {target} downloaded and verified (use --out or --mirror)")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    sub = Subscriber(open_store(args.store))
    target = sub.latest() if args.version is None else args.version
    if target is None:
        raise DeltaSyncError("nothing has been published yet")
    m = sub.manifest(target)
    if args.json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(m)).decode() + "\n")
        return 0
    out = Console()
    dense = m.dense_bytes
    out.print(
        f"version {m.version}  anchor {m.anchor_version}  tensors {len(m.tensors())}  "
        f"dense {dense:,} bytes  chunk {m.chunk_bytes:,} bytes  digest {m.digest}"
    )
    table = Table("part", "payload", "base", "bytes", "ratio", "changed", "shards", "chunks")
    for part in m.parts:
        numel = sum(int(np.prod(t.shape)) for t in part.tensors)
        part_dense = sum(int(np.prod(t.shape)) * itemsize(t.dtype) for t in part.tensors)
        for p in part.payloads:
            table.add_row(
                part.name,
                p.kind,
                "-" if p.base_version is None else str(p.base_version),
                f"{p.nbytes:,}",
                f"{part_dense / max(p.nbytes, 1):.1f}x",
                f"{100 * p.changed / max(numel, 1):.2f}%",
                str(len(p.shards)),
                ", ".join(f"{k} {v}" for k, v in sorted(p.chunks.items())),
            )
    out.print(table)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from tandem.delta_sync.server import StoreServer

    server = StoreServer(args.root, args.host, args.port)
    console.print(f"serving {Path(args.root).resolve()} read-only at {server.url}")
    _serve_until_interrupted(server)
    return 0


def _serve_until_interrupted(server: Any) -> None:
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.httpd.server_close()


def cmd_relay(args: argparse.Namespace) -> int:
    from tandem.delta_sync.server import StoreServer
    from tandem.delta_sync.stores.relay import RelayStore

    relay = RelayStore(open_store(args.origin), LocalStore(args.cache), latest_ttl=args.latest_ttl)
    server = StoreServer(relay, args.host, args.port)
    console.print(f"relaying {relay.describe()} read-only at {server.url}")
    _serve_until_interrupted(server)
    console.print(f"relay: {relay.stats}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from tandem.delta_sync import bench

    workers = args.workers or default_workers()
    shapes = bench.moe_shapes(args.mb << 20)
    lrs = [float(x) for x in args.lrs.split(",")]
    tmp, stores = bench.default_local_stores()
    with tmp:
        rows = bench.run(
            bench.adam_snapshots(shapes, lrs),
            workers=workers,
            stores=stores,
            repeat=args.repeat,
            echo=console.print,
        )
    print(bench.format_table(rows, workers))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="delta-sync", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    pub = sub.add_parser("publish", help="publish a state file as the next version")
    pub.add_argument("store")
    pub.add_argument("file", help=".safetensors or .npz")
    pub.add_argument("--version", type=int, required=True)
    pub.add_argument("--anchor-every", type=int, default=25)
    pub.add_argument("--shard-mb", type=int, default=32)
    pub.add_argument("--chunk-mb", type=int, default=4)
    pub.add_argument("--workers", type=int, default=None)
    pub.set_defaults(fn=cmd_publish)

    pull = sub.add_parser("pull", help="download, verify and rebuild a version")
    pull.add_argument("store")
    pull.add_argument("--version", type=int, default=None)
    pull.add_argument("--out", help="write the version to this .safetensors file")
    pull.add_argument("--mirror", help="copy the version's objects into this store (a relay)")
    pull.add_argument("--workers", type=int, default=None)
    pull.set_defaults(fn=cmd_pull)

    ins = sub.add_parser("inspect", help="summarise a version's manifest")
    ins.add_argument("store")
    ins.add_argument("--version", type=int, default=None)
    ins.add_argument("--json", action="store_true")
    ins.set_defaults(fn=cmd_inspect)

    srv = sub.add_parser("serve", help="serve a store directory read-only over HTTP")
    srv.add_argument("root")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8080)
    srv.set_defaults(fn=cmd_serve)

    rel = sub.add_parser(
        "relay", help="serve a remote store over HTTP, fetching each object once into a cache"
    )
    rel.add_argument("origin", help="the store the trainer publishes to (s3://, http://, a path)")
    rel.add_argument("--cache", required=True, help="directory for the relay's copies")
    rel.add_argument("--latest-ttl", type=float, default=1.0, help="seconds to hold `latest`")
    rel.add_argument("--host", default="127.0.0.1")
    rel.add_argument("--port", type=int, default=8080)
    rel.set_defaults(fn=cmd_relay)

    b = sub.add_parser("bench", help="measure ratios and throughput on Adam-made deltas")
    b.add_argument("--mb", type=int, default=256, help="dense bf16 megabytes of the state")
    b.add_argument("--lrs", default="5e-7,1e-6,2e-6,5e-6,1e-5")
    b.add_argument("--workers", type=int, default=None)
    b.add_argument("--repeat", type=int, default=2)
    b.set_defaults(fn=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # this is the application entry point: library events go to stderr, stdout stays data
    structlog.configure(
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
    )
    try:
        return args.fn(args)
    except DeltaSyncError as e:
        console.print(f"[red]delta-sync: {e}[/red]")
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
