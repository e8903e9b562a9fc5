"""Cross-region weight flow: engines pulling from the origin directly versus through a
relay per region, measured side by side in one run.

The trainer publishes to an S3 endpoint (moto's server on loopback). Each of `--regions`
regions has `--engines` engines (a Subscriber and a bf16 state each, pulling in threads).
For the anchor and for each following delta the script prints, for both layouts: the time
from the end of `publish` to every engine holding the new version, and the bytes taken
from the origin. A relay is `RelayStore(origin, cache)` behind `StoreServer`, as
`delta-sync relay` runs it.

    uv run python benchmarks/weight_flow.py [--mb 64] [--regions 2] [--engines 3] [--steps 3]
"""

from __future__ import annotations

import argparse
import logging
import socket
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import boto3
import numpy as np
import structlog

from tandem.delta_sync import HttpStore, LocalStore, Publisher, RelayStore, S3Store, Subscriber
from tandem.delta_sync.bench import adam_snapshots, moe_shapes
from tandem.delta_sync.server import StoreServer


class MeteredS3(S3Store):
    """An S3Store that counts the bytes it downloads (what leaves the origin)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.bytes_out = 0
        self._count = threading.Lock()

    def get(self, key: str) -> bytes:
        data = super().get(key)
        with self._count:
            self.bytes_out += len(data)
        return data


def run_layout(relay: bool, versions, endpoint: str, args, tmp: str) -> list[tuple[float, int]]:
    """[(seconds from publish end to all engines on the version, origin bytes)] per version."""
    creds = {"aws_access_key_id": "b", "aws_secret_access_key": "b", "region_name": "us-east-1"}
    bucket = f"flow-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=endpoint, **creds).create_bucket(Bucket=bucket)
    origin = MeteredS3(bucket, "run", endpoint_url=endpoint, **creds)
    publisher_store = S3Store(bucket, "run", endpoint_url=endpoint, **creds)
    servers, subs = [], []
    for r in range(args.regions):
        if relay:
            cache = LocalStore(f"{tmp}/{bucket}-region{r}")
            servers.append(StoreServer(RelayStore(origin, cache)).start())
        for _ in range(args.engines):
            store = HttpStore(servers[-1].url) if relay else origin
            subs.append(Subscriber(store, workers=1))
    engines = [{k: np.empty_like(v) for k, v in versions[0].items()} for _ in subs]
    rows = []
    try:
        with (
            Publisher(publisher_store, anchor_every=1 << 30) as pub,
            ThreadPoolExecutor(len(subs)) as pool,
        ):
            for v, state in enumerate(versions):
                pub.publish(v, state)
                before = origin.bytes_out
                t = time.perf_counter()
                done = list(pool.map(lambda i: subs[i].pull(engines[i]).version, range(len(subs))))
                assert done == [v] * len(subs)
                rows.append((time.perf_counter() - t, origin.bytes_out - before))
        for e in engines:  # every engine holds the last version bit for bit
            assert all(
                np.array_equal(e[k].view(np.uint16), versions[-1][k].view(np.uint16)) for k in e
            )
    finally:
        for s in subs:
            s.close()
        for server in servers:
            server.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=64, help="dense bf16 MB of the model")
    ap.add_argument("--regions", type=int, default=2)
    ap.add_argument("--engines", type=int, default=3, help="engines per region")
    ap.add_argument("--steps", type=int, default=3, help="deltas after the anchor")
    ap.add_argument("--lr", type=float, default=2e-6)
    args = ap.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    pairs = adam_snapshots(moe_shapes(args.mb << 20), [args.lr] * args.steps)
    versions = []
    for _, before, after in pairs:
        versions = versions or [before]
        versions.append(after)
    dense = sum(a.nbytes for a in versions[0].values())
    print(
        f"{dense / 2**20:.0f} MiB bf16 state, {args.regions} regions x {args.engines} engines, "
        f"anchor then {args.steps} deltas at lr {args.lr:g}",
        flush=True,
    )
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        with tempfile.TemporaryDirectory(prefix="weight-flow-") as tmp:
            direct = run_layout(False, versions, f"http://127.0.0.1:{port}", args, tmp)
            relayed = run_layout(True, versions, f"http://127.0.0.1:{port}", args, tmp)
    finally:
        server.stop()
    print(
        f"\n{'version':>8} {'direct s':>9} {'relay s':>8} {'direct origin MB':>17} "
        f"{'relay origin MB':>16} {'origin bytes x':>15}"
    )
    for v, ((ds, db), (rs, rb)) in enumerate(zip(direct, relayed, strict=True)):
        kind = "anchor" if v == 0 else f"delta {v}"
        print(
            f"{kind:>8} {ds:>9.2f} {rs:>8.2f} {db / 1e6:>17.2f} {rb / 1e6:>16.2f} "
            f"{db / max(rb, 1):>15.1f}"
        )
    print(
        "\nseconds = from the end of publish to every engine on the new version; origin MB = "
        "bytes downloaded from the S3 origin (all regions together)."
    )


if __name__ == "__main__":
    main()
