"""Delta sync over an emulated WAN, against a full snapshot and against the planner.

Needs root (network namespaces, `tc tbf`, a round-trip proxy: `tandem.delta_sync.testing`).
For each topology the trainer publishes an anchor, which every engine already holds (as
after an earlier pull; the relays' caches start empty), and one step is published and
pulled (so kept-alive connections, engine to relay to origin, are open as in steady
state), then:

    delta   publish the next version (~2% of the weights moved by an ulp or two), time from
            the start of publish to every engine holding it, bit-exact; each engine waits
            for it with a long-poll for its manifest (held by its relay and the origin)
    full    (first topology) a full snapshot of the next version through the same links,
            pulled by engines that start from nothing

and prints it next to the network limit (the bottleneck link's bytes at its rate) and to
`delta-sync plan`'s prediction, made with codec throughputs measured here first (the same
measurement as `delta-sync bench`, wall clock: on a machine shared with other jobs the
roles get less than a core each).

    sudo uv run python benchmarks/delta_sync_wan.py [--mb 64] [--changed 0.02]
    sudo uv run python benchmarks/delta_sync_wan.py --mb 256 --topologies A --no-full
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import msgspec
import numpy as np
import structlog

from tandem.delta_sync import LocalStore, Publisher, warm_up
from tandem.delta_sync.bench import measure_codec, moe_shapes
from tandem.delta_sync.plan import GBIT, Codec, Region, Scenario, plan, value_bits_from
from tandem.delta_sync.testing import netns
from tandem.delta_sync.testing.wan import RegionSpec, Topology, Wan, bits_digest

# Links here are ~100x slower than a datacenter's, so shards are smaller by as much: a relay
# fetches a whole shard before it serves it, and a 32 MiB shard would take 30 s on 10 Mbit/s.
SHARD = 2 << 20

TOPOLOGIES = {
    "A: 2 regions share a 20 Mbit/s uplink, relays, 100/250 ms": Topology(
        [RegionSpec("eu", 1, 50, 100), RegionSpec("ap", 1, 50, 250)], uplink_mbit=20
    ),
    "B: 2 regions x 2 engines, relays, 30/20 Mbit/s links, 50/150 ms": Topology(
        [RegionSpec("us", 2, 30, 50), RegionSpec("eu", 2, 20, 150)], uplink_mbit=100
    ),
    "C: 2 regions x 2 engines, no relays, 40 Mbit/s uplink, 100/200 ms": Topology(
        [RegionSpec("eu", 2, 100, 100, relay=False), RegionSpec("ap", 2, 100, 200, relay=False)],
        uplink_mbit=40,
    ),
}


def states(mb: int, changed: float, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Four versions: v0, then three steps each moving `changed` of the weights by 1-2 ulps."""
    rng = np.random.default_rng(seed)
    v0 = {
        k: (rng.standard_normal(s, np.float32) * 0.02).astype(ml_dtypes.bfloat16)
        for k, s in moe_shapes(mb << 20).items()
    }
    out = [v0]
    for _ in range(3):
        nxt = {k: a.copy() for k, a in out[-1].items()}
        for a in nxt.values():
            bits = a.reshape(-1).view(np.uint16)
            idx = np.flatnonzero(rng.random(bits.size) < changed)
            bits[idx] += rng.choice(
                np.array([1, 1, 2, 0xFFFF, 0xFFFF, 0xFFFE], np.uint16), idx.size
            )
        out.append(nxt)
    return out


def scenario_of(t: Topology, mb_bytes: float, changed: float, workers: int) -> Scenario:
    regions = [
        Region(r.name, r.engines, r.rate_mbit / 1e3, r.rtt_ms, r.relay, r.in_region_mbit / 1e3)
        for r in t.regions
    ]
    return Scenario(
        model_bytes=mb_bytes,
        regions=regions,
        uplink_gbit=t.uplink_mbit / 1e3,
        changed=changed,
        shard_bytes=SHARD,
        trainer_cores=workers,
        engine_cores=1,
        store_gbit=10.0,
    )


def network_limit(s: Scenario, payload: float) -> float:
    """Seconds the payload's bytes alone need at the busiest link (bytes / rate)."""
    flows = [1 if r.relay else r.engines for r in s.regions]
    uplink = payload * sum(flows) / (s.uplink_gbit * GBIT)
    regions = [payload * f / (r.rate_gbit * GBIT) for r, f in zip(s.regions, flows, strict=True)]
    return max(uplink, *regions)


def round_trip_floor(s: Scenario, codec: Codec, payload: float) -> float:
    """Seconds the protocol needs with an infinitely fast codec: each region's round trips
    (the long-poll's answer, then a round trip per wave of shards) before its bytes, and the
    bytes through the fairly shared links, as the planner models them."""
    instant = msgspec.structs.replace(codec, encode_gbps_core=1e9, apply_gbps_core=1e9)
    return plan(s, instant, payload=payload).total_s


def run_topology(name: str, topo: Topology, versions, codec: Codec, args, full: bool) -> dict:
    dense = sum(a.nbytes for a in versions[0].values())
    with (
        tempfile.TemporaryDirectory(prefix="wan-") as tmp,
        Wan(topo, Path(tmp), http_timeout=120) as w,
    ):
        pub = Publisher(
            LocalStore(w.origin_dir),
            anchor_every=3,
            workers=args.workers,
            shard_bytes=SHARD,
            chunk_bytes=SHARD // 2,
        )
        pub.publish(0, versions[0])
        for e in w.engines:  # engines that pulled version 0 earlier: their relays start empty
            e.state = {k: a.copy() for k, a in versions[0].items()}
            e.sub.version = 0
        pub.publish(1, versions[1])  # a step before: connections open as in steady state
        assert all(r.get("digest") == bits_digest(versions[1]) for r in w.pull_all(timeout=900))
        waiting = w.await_next(wait=60)  # each engine's long-poll for the next manifest
        time.sleep(1.0)  # held at the origin by now (round trips are at most 250 ms)
        t0 = time.time()
        report = pub.publish(2, versions[2])
        results = w.gather(waiting, timeout=900)
        delta_s = max(r["done"] for r in results) - t0
        assert all(r.get("digest") == bits_digest(versions[2]) for r in results), results
        row = {"delta_s": delta_s, "delta_bytes": report.step_bytes}
        if full:  # the next version as a full snapshot to engines starting from nothing
            for e in w.engines:
                e.sub.version, e.state = None, None
            w.poll()
            t0 = time.time()
            report = pub.publish(3, versions[3])  # an anchor (anchor_every=3)
            results = w.pull_all(timeout=1800)
            row["full_s"] = max(r["done"] for r in results) - t0
            row["full_bytes"] = next(p.nbytes for p in report.payloads if p.kind == "full")
            assert all(r.get("digest") == bits_digest(versions[3]) for r in results), results
        pub.close()
    s = scenario_of(topo, dense, args.changed, args.workers)
    row["plan_s"] = plan(s, codec, payload=row["delta_bytes"]).total_s
    row["limit_s"] = network_limit(s, row["delta_bytes"])
    row["floor_s"] = round_trip_floor(s, codec, row["delta_bytes"])
    if full:
        row["plan_full_s"] = plan(s, codec, payload=row["full_bytes"], full=True).total_s
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=64, help="dense bf16 MB of the state")
    ap.add_argument("--changed", type=float, default=0.02)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--topologies", default="A,B,C", help="which ones, by letter")
    ap.add_argument("--no-full", action="store_true", help="skip the full-snapshot run")
    args = ap.parse_args()
    why = netns.unavailable()
    if why is not None:
        raise SystemExit(f"delta_sync_wan: {why}")
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    # a SIGTERM unwinds like an exception, so the namespaces are deleted on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    warm_up((2,))
    versions = states(args.mb, args.changed)
    row = measure_codec(versions[0], versions[1], args.workers, repeat=1)
    # wall-clock throughputs, as the emulation's roles get them on this machine (shared
    # with whatever else runs): the publisher's workers together, one engine's one worker
    codec = Codec(
        encode_gbps_core=row.encode_all / args.workers,
        apply_gbps_core=row.decode_1,
        value_bits=value_bits_from(row.ratio, row.changed, 2),
        full_ratio=row.full_zstd,
        measured_on="measure_codec here (as delta-sync bench)",
    )
    dense = sum(a.nbytes for a in versions[0].values())
    print(
        f"{dense / 2**20:.0f} MiB bf16, {row.changed:.2%} changed, ratio {row.ratio:.1f}x; codec "
        f"wall clock per worker: encode {codec.encode_gbps_core:.2f} GB/s ({args.workers} "
        f"workers), decode+apply {codec.apply_gbps_core:.2f} GB/s (1 worker); per CPU-second "
        f"{row.encode_cpu:.2f} and {row.decode_cpu:.2f} GB",
        flush=True,
    )
    print(
        f"{'topology':<66} {'delta MB':>8} {'delta s':>7} {'limit s':>7} {'/limit':>6} "
        f"{'floor s':>7} {'/limit':>6} {'plan s':>6} {'plan err':>8} {'full s':>7} "
        f"{'full/delta':>10}"
    )
    chosen = [(n, t) for n, t in TOPOLOGIES.items() if n[0] in args.topologies.split(",")]
    for i, (name, topo) in enumerate(chosen):
        r = run_topology(name, topo, versions, codec, args, full=i == 0 and not args.no_full)
        err = (r["plan_s"] - r["delta_s"]) / r["delta_s"]
        full = f"{r['full_s']:>7.1f} {r['full_s'] / r['delta_s']:>10.1f}" if "full_s" in r else ""
        print(
            f"{name:<66} {r['delta_bytes'] / 1e6:>8.2f} {r['delta_s']:>7.2f} {r['limit_s']:>7.2f} "
            f"{r['delta_s'] / r['limit_s']:>6.2f} {r['floor_s']:>7.2f} "
            f"{r['floor_s'] / r['limit_s']:>6.2f} {r['plan_s']:>6.2f} {err:>+8.0%} {full}",
            flush=True,
        )
        if "full_s" in r:
            ferr = (r["plan_full_s"] - r["full_s"]) / r["full_s"]
            print(f"{'':<66} full snapshot: plan {r['plan_full_s']:.1f} s ({ferr:+.0%})")
    print(
        "\ndelta s / full s: from the start of publish to every engine applied (bit-exact); "
        "limit s: the delta's bytes at the busiest link's rate; floor s: the round trips "
        "before each region's bytes plus the bytes, with an instant codec (no protocol "
        "that asks for the shards after learning the version can beat it); plan s: "
        "delta-sync plan."
    )


if __name__ == "__main__":
    main()
