"""`delta-sync`: publish, pull, inspect, serve, relay and bench from the command line.

    delta-sync publish STORE model.safetensors --version 7
    delta-sync pull STORE --out model.safetensors          # rebuild the latest version
    delta-sync pull s3://bucket/run --mirror /srv/relay    # copy it into a relay directory
    delta-sync inspect STORE [--version 7] [--json]
    delta-sync serve /srv/relay --port 8080                # read-only HTTP for a directory
    delta-sync relay s3://bucket/run --cache /srv/cache    # per-region read-through cache
    delta-sync bench --mb 256 [--json codec.json]
    delta-sync plan --model-gb 140 --regions us,eu --rtt-ms 20,150 --bench codec.json

STORE is a directory, file://DIR, s3://BUCKET/PREFIX or http(s)://HOST/PATH.
Every failure is one line, `delta-sync: ...`, on stderr, and exit status 1.
"""

from __future__ import annotations

import argparse
import sys
import zipfile
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from rich.console import Console
from rich.table import Table

from tandem.delta_sync import safetensors_io
from tandem.delta_sync.cli_output import configure_logging, make_console, transfer_progress
from tandem.delta_sync.dtypes import itemsize
from tandem.delta_sync.errors import DeltaSyncError
from tandem.delta_sync.manifest import LATEST_KEY, manifest_key
from tandem.delta_sync.parallel import default_workers
from tandem.delta_sync.plan_cli import add_plan_parser
from tandem.delta_sync.stores import LocalStore, open_store
from tandem.delta_sync.stores.base import nothing_published
from tandem.delta_sync.stores.local import os_error_message
from tandem.delta_sync.subscriber import Subscriber


def load_state(path: str) -> dict[str, np.ndarray]:
    if not path.endswith((".safetensors", ".npz")):
        raise DeltaSyncError(f"{path}: expected a .safetensors or .npz file")
    if not Path(path).is_file():
        raise DeltaSyncError(f"{path}: no such file")
    if path.endswith(".safetensors"):
        return safetensors_io.load(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise DeltaSyncError(f"{path}: not a readable .npz file ({e})") from None


def cmd_publish(args: argparse.Namespace, console: Console) -> int:
    from tandem.delta_sync.publisher import Publisher

    # the store first: a read-only or unknown store is refused before the file is read
    pub = Publisher(
        open_store(args.store),
        anchor_every=args.anchor_every,
        shard_bytes=args.shard_mb << 20,
        chunk_bytes=args.chunk_mb << 20,
        workers=args.workers,
    )
    state = load_state(args.file)
    with pub, transfer_progress(console) as progress:
        pub.progress = progress  # rebuild (a store with versions), encode, upload
        report = pub.publish(args.version, state)
    kind = "anchor" if report.is_anchor else "delta"
    console.print(
        f"published version {report.version} ({kind}): {report.step_bytes:,} bytes for "
        f"{report.dense_bytes:,} dense ({report.ratio:.1f}x) in {report.seconds:.2f} s"
    )
    return 0


def cmd_pull(args: argparse.Namespace, console: Console) -> int:
    store = open_store(args.store)
    dest = open_store(args.mirror) if args.mirror else None
    if dest is not None and dest.read_only:
        raise DeltaSyncError(f"cannot mirror into {dest.describe()}: it is a read-only store")
    sub = Subscriber(store, workers=args.workers)
    target = sub.latest() if args.version is None else args.version
    if target is None:
        raise nothing_published(store)
    path = sub.plan(target, None)
    keys = [
        ref
        for v, base in path
        for part in sub.manifest(v).parts
        for ref in part.payload_from(base).shards  # type: ignore[union-attr]
    ]
    total = sum(r.nbytes for r in keys)
    if dest is not None:
        with transfer_progress(console, {"mirror": total}) as progress:
            for ref in keys:
                if not dest.exists(ref.key):
                    dest.put(ref.key, store.get(ref.key))
                progress("mirror", ref.nbytes)
        for v, _ in path:
            dest.put(manifest_key(v), store.get(manifest_key(v)))
        if args.version is None:
            dest.put(LATEST_KEY, store.get(LATEST_KEY))
        console.print(f"mirrored version {target} into {dest.describe()} ({total:,} bytes)")
    if args.out or not args.mirror:
        with transfer_progress(console, {"download": total}) as progress:
            sub.progress = progress
            arrays = sub.materialize(target)
        if args.out:
            safetensors_io.save(args.out, arrays)
            console.print(f"wrote version {target} ({len(arrays)} tensors) to {args.out}")
        else:
            console.print(f"version {target} downloaded and verified (use --out or --mirror)")
    return 0


def cmd_inspect(args: argparse.Namespace, console: Console) -> int:
    sub = Subscriber(open_store(args.store))
    target = sub.latest() if args.version is None else args.version
    if target is None:
        raise nothing_published(sub.store)
    m = sub.manifest(target)
    if args.json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(m)).decode() + "\n")
        return 0
    out = make_console(stderr=False)
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


def cmd_serve(args: argparse.Namespace, console: Console) -> int:
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


def cmd_relay(args: argparse.Namespace, console: Console) -> int:
    from tandem.delta_sync.server import StoreServer
    from tandem.delta_sync.stores.relay import RelayStore

    relay = RelayStore(open_store(args.origin), LocalStore(args.cache), latest_ttl=args.latest_ttl)
    server = StoreServer(relay, args.host, args.port)
    console.print(f"relaying {relay.describe()} read-only at {server.url}")
    _serve_until_interrupted(server)
    console.print(f"relay: {relay.stats}")
    return 0


def cmd_bench(args: argparse.Namespace, console: Console) -> int:
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
    if args.json:  # the codec figures `delta-sync plan --bench` reads
        import dataclasses
        import json

        data = {"workers": workers, "mb": args.mb, "rows": [dataclasses.asdict(r) for r in rows]}
        Path(args.json).write_text(json.dumps(data, indent=1))
    return 0


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default, unless the option is required or its
    help already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or action.required or "default" in text:
            return text
        if action.default in (None, argparse.SUPPRESS):
            return text
        default = ("on" if action.default else "off") if action.const is True else "%(default)s"
        return f"{text} (default: {default})"


_STORE = "a directory, file://DIR, s3://BUCKET/PREFIX or http(s)://HOST/PATH"
_WORKERS = "threads for encoding and decoding (default: one per CPU core)"
_VERSION_LATEST = "the version (default: the latest)"


def _subparser(sub: Any, name: str, help: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help, description=help, formatter_class=_HelpFormatter)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="delta-sync", description=__doc__, formatter_class=_HelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    pub = _subparser(sub, "publish", "publish a state file as the next version")
    pub.add_argument(
        "store", help="where to publish: a directory, file://DIR or s3://BUCKET/PREFIX"
    )
    pub.add_argument("file", help="the state: a .safetensors or .npz file")
    pub.add_argument("--version", type=int, required=True, help="the version number to publish")
    pub.add_argument("--anchor-every", type=int, default=25, help="versions between full anchors")
    pub.add_argument("--shard-mb", type=int, default=32, help="shard size in MiB")
    pub.add_argument("--chunk-mb", type=int, default=4, help="chunk size in MiB")
    pub.add_argument("--workers", type=int, default=None, help=_WORKERS)
    pub.set_defaults(fn=cmd_publish)

    pull = _subparser(sub, "pull", "download, verify and rebuild a version")
    pull.add_argument("store", help=f"where to pull from: {_STORE}")
    pull.add_argument("--version", type=int, default=None, help=_VERSION_LATEST)
    pull.add_argument(
        "--out", help="write the version to this .safetensors file (default: only verify it)"
    )
    pull.add_argument(
        "--mirror",
        help="copy the version's objects into this store, e.g. a relay directory (default: none)",
    )
    pull.add_argument("--workers", type=int, default=None, help=_WORKERS)
    pull.set_defaults(fn=cmd_pull)

    ins = _subparser(sub, "inspect", "summarise a version's manifest")
    ins.add_argument("store", help=f"the store: {_STORE}")
    ins.add_argument("--version", type=int, default=None, help=_VERSION_LATEST)
    ins.add_argument("--json", action="store_true", help="print the manifest as JSON")
    ins.set_defaults(fn=cmd_inspect)

    srv = _subparser(sub, "serve", "serve a store directory read-only over HTTP")
    srv.add_argument("root", help="the store directory to serve")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on")
    srv.add_argument("--port", type=int, default=8080, help="port to listen on (0: any free one)")
    srv.set_defaults(fn=cmd_serve)

    rel = _subparser(
        sub, "relay", "serve a remote store over HTTP, fetching each object once into a cache"
    )
    rel.add_argument("origin", help="the store the trainer publishes to (s3://, http://, a path)")
    rel.add_argument("--cache", required=True, help="directory for the relay's copies")
    rel.add_argument("--latest-ttl", type=float, default=1.0, help="seconds to hold `latest`")
    rel.add_argument("--host", default="127.0.0.1", help="address to listen on")
    rel.add_argument("--port", type=int, default=8080, help="port to listen on (0: any free one)")
    rel.set_defaults(fn=cmd_relay)

    b = _subparser(sub, "bench", "measure ratios and throughput on Adam-made deltas")
    b.add_argument("--mb", type=int, default=256, help="dense bf16 megabytes of the state")
    b.add_argument(
        "--lrs", default="5e-7,1e-6,2e-6,5e-6,1e-5", help="learning rates, comma-separated"
    )
    b.add_argument("--workers", type=int, default=None, help=_WORKERS)
    b.add_argument("--repeat", type=int, default=2, help="timed runs per measurement")
    b.add_argument(
        "--json",
        default=None,
        help="also write the figures to this file, for `plan` (default: not written)",
    )
    b.set_defaults(fn=cmd_bench)
    add_plan_parser(sub, _subparser)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # the application entry point: bars, messages and library log events share one
    # console on stderr (stdout stays data)
    console = make_console()
    configure_logging(console)
    try:
        return args.fn(args, console)
    except DeltaSyncError as e:
        message = str(e)
    except OSError as e:  # a file or socket the command itself opened
        where = f"{e.filename}: " if e.filename else ""
        message = f"{where}{os_error_message(e)}"
    console.print(f"delta-sync: {' '.join(message.split())}", style="red")
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
