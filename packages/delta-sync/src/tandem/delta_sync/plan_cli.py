"""`delta-sync plan`: the planner's command line, and the scenario it is compared with.

    delta-sync bench --mb 256 --json codec.json          # once, on the machines you have
    delta-sync plan --model-gb 140 --changed 0.02 --bench codec.json \\
        --uplink-gbit 10 --regions us,eu,ap --engines 4 --rate-gbit 5,2,2 --rtt-ms 20,90,180
    delta-sync plan --composer2 --bench codec.json       # 1 TB, four regions, relays
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import msgspec

from tandem.delta_sync.dtypes import itemsize
from tandem.delta_sync.errors import DeltaSyncError
from tandem.delta_sync.plan import Codec, Plan, Region, Scenario, plan, value_bits_from

# Measured on a 2-core development machine (benchmarks/delta_sync_wan.py's codec pass on a
# 69 MiB bf16 state at 2% changed: 87x); replace them with your own (`--bench`), since
# encode and apply throughput decide the CPU-bound part.
DEV_MACHINE = Codec(
    encode_gbps_core=2.5,
    apply_gbps_core=2.8,
    value_bits=2.1,
    full_ratio=1.3,
    measured_on="defaults from a 2-core development machine (pass --bench for yours)",
)

DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": "float8_e4m3fn"}

COMPOSER2_PUBLIC = [
    "~1 TB snapshot (bf16), deltas after every step to four inference clusters on other continents",
    "every cluster updated in under a minute, with a ~30 s pause",
]

COMPOSER2_ASSUMED = "1 TB bf16, 2% changed, 4 regions with a relay each, 16 engines per region"


def composer2(trainer_cores: int = 512, engine_cores: int = 64) -> Scenario:
    """The scenario quoted in the README: the public figures plus stated assumptions."""
    regions = [
        Region("us-east", 16, 25.0, 70.0, in_region_gbit=100.0),
        Region("eu-west", 16, 10.0, 140.0, in_region_gbit=100.0),
        Region("ap-south", 16, 10.0, 220.0, in_region_gbit=100.0),
        Region("ap-east", 16, 10.0, 250.0, in_region_gbit=100.0),
    ]
    return Scenario(
        model_bytes=1e12,
        regions=regions,
        uplink_gbit=40.0,
        changed=0.02,
        shard_bytes=64 << 20,
        trainer_cores=trainer_cores,
        engine_cores=engine_cores,
        download_workers=32,
        store_gbit=100.0,
    )


def load_codec(path: str | None, changed: float | None = None) -> Codec:
    """Codec figures from a `delta-sync bench --json` file (the row nearest `changed`)."""
    if path is None:
        return DEV_MACHINE
    try:
        data = json.loads(Path(path).read_text())
        rows = data["rows"]
        row = min(rows, key=lambda r: abs(r["changed"] - (changed or r["changed"])))
        return Codec(
            encode_gbps_core=row["encode_cpu"],
            apply_gbps_core=row["decode_cpu"],
            value_bits=value_bits_from(row["ratio"], row["changed"], 2),
            full_ratio=row["full_zstd"],
            measured_on=f"{path} ({data.get('workers', '?')} workers, {data.get('mb', '?')} MB)",
        )
    except FileNotFoundError:
        raise DeltaSyncError(
            f"{path}: no such file (make it with `delta-sync bench --json`)"
        ) from None
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise DeltaSyncError(f"{path}: not a `delta-sync bench --json` file ({e!r})") from None


def _floats(text: str, n: int, what: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",")]
    except ValueError:
        raise DeltaSyncError(
            f"{what}: expected numbers separated by commas, got {text!r}"
        ) from None
    if len(vals) == 1:
        vals = vals * n
    if len(vals) != n or any(v <= 0 for v in vals):
        raise DeltaSyncError(f"{what}: expected 1 or {n} positive values, got {text!r}")
    return vals


def model_bytes_of(args: argparse.Namespace) -> float:
    if args.checkpoint is None:
        return args.model_gb * 1e9
    root = Path(args.checkpoint)
    files = sorted(root.glob("*.safetensors")) if root.is_dir() else [root]
    if not files or not files[0].is_file():
        raise DeltaSyncError(f"{root}: no .safetensors files there")
    return float(sum(f.stat().st_size for f in files))


def scenario_from(args: argparse.Namespace) -> Scenario:
    names = args.regions.split(",")
    n = len(names)
    engines = [int(x) for x in _floats(args.engines, n, "--engines")]
    rates = _floats(args.rate_gbit, n, "--rate-gbit")
    rtts = _floats(args.rtt_ms, n, "--rtt-ms")
    inner = _floats(args.in_region_gbit, n, "--in-region-gbit")
    if not 0 < args.changed < 1:
        raise DeltaSyncError(f"--changed must be a fraction in (0, 1), got {args.changed}")
    regions = [
        Region(names[i], engines[i], rates[i], rtts[i], not args.no_relay, inner[i])
        for i in range(n)
    ]
    return Scenario(
        model_bytes=model_bytes_of(args),
        regions=regions,
        uplink_gbit=args.uplink_gbit,
        itemsize=itemsize(DTYPE_ALIASES.get(args.dtype, args.dtype)),
        changed=args.changed,
        shard_bytes=args.shard_mb << 20,
        trainer_cores=args.trainer_cores,
        engine_cores=args.engine_cores,
        download_workers=args.download_workers,
        long_poll=not args.polling,
    )


def format_plan(s: Scenario, p: Plan, full: Plan | None = None) -> str:
    lines = [
        f"model {s.model_bytes / 1e9:,.1f} GB, {s.changed:.1%} changed, "
        f"{sum(r.engines for r in s.regions)} engines in {len(s.regions)} regions",
        f"delta {p.delta_bytes / 1e6:,.1f} MB; origin uplink carries "
        f"{p.uplink_bytes / 1e6:,.1f} MB ({s.uplink_gbit:g} Gbit/s)",
        f"prepare (trainer encode+upload) {p.prepare_s:.2f} s; apply pause {p.apply_s:.2f} s",
        f"{'region':>10} {'engines':>7} {'relay':>5} {'link MB':>10} {'Gbit/s':>7} "
        f"{'fetch s':>8} {'all applied s':>13}",
    ]
    for r, t in zip(s.regions, p.regions, strict=True):
        lines.append(
            f"{r.name:>10} {r.engines:>7} {'yes' if r.relay else 'no':>5} "
            f"{t.bytes_in / 1e6:>10,.1f} {t.rate_gbit:>7.2f} {t.fetch_s:>8.2f} {t.done_s:>13.2f}"
        )
    lines.append(f"time to every engine: {p.total_s:.2f} s (bottleneck: {p.bottleneck})")
    if full is not None:
        lines.append(
            f"a full snapshot through the same links: {full.total_s:.2f} s "
            f"({full.total_s / p.total_s:.1f}x the delta)"
        )
    lines += [f"  - {n}" for n in p.notes]
    return "\n".join(lines)


def cmd_plan(args: argparse.Namespace, console: Any) -> int:
    if args.composer2:
        s = composer2(args.trainer_cores * 64, args.engine_cores * 8)
    else:
        s = scenario_from(args)
    codec = load_codec(args.bench, s.changed)
    p, full = plan(s, codec), plan(s, codec, full=True)
    if args.json:
        print(
            msgspec.json.encode({"scenario": s, "codec": codec, "plan": p, "full": full}).decode()
        )
        return 0
    if args.composer2:
        print("Composer 2, public figures:")
        print("\n".join(f"  - {x}" for x in COMPOSER2_PUBLIC))
        print(
            f"assumed: {COMPOSER2_ASSUMED}; trainer encodes on {s.trainer_cores} cores "
            f"(64 ranks x {args.trainer_cores}), each engine applies on {s.engine_cores} cores "
            f"(8 hosts x {args.engine_cores}), origin uplink {s.uplink_gbit:g} Gbit/s"
        )
    print(format_plan(s, p, full))
    return 0


def add_plan_parser(sub: Any, make: Any) -> None:
    pl = make(sub, "plan", "predict one sync step: bytes per link, times, bottleneck")
    size = pl.add_mutually_exclusive_group()
    size.add_argument("--model-gb", type=float, default=16.0, help="dense size of the state, GB")
    size.add_argument(
        "--checkpoint",
        default=None,
        help="a .safetensors file or directory, for the size (default: --model-gb)",
    )
    pl.add_argument("--dtype", default="bf16", help="element type: bf16, fp16, fp32, fp8, ...")
    pl.add_argument("--changed", type=float, default=0.02, help="fraction changed per step")
    pl.add_argument("--shard-mb", type=int, default=32, help="shard size in MiB")
    pl.add_argument("--trainer-cores", type=int, default=8, help="encode workers (all ranks)")
    pl.add_argument("--engine-cores", type=int, default=8, help="apply workers per engine")
    pl.add_argument("--download-workers", type=int, default=8, help="parallel shard requests")
    pl.add_argument(
        "--polling",
        action="store_true",
        help="engines poll `latest` (a round trip after the commit) instead of waiting for "
        "the next manifest with a long-poll (half a round trip)",
    )
    pl.add_argument("--uplink-gbit", type=float, default=10.0, help="the origin's uplink")
    pl.add_argument("--regions", default="local", help="region names, comma-separated")
    pl.add_argument("--engines", default="1", help="engines per region (one or one each)")
    pl.add_argument("--rate-gbit", default="10", help="each region's link rate, Gbit/s")
    pl.add_argument("--rtt-ms", default="1", help="each region's round trip to the origin")
    pl.add_argument("--in-region-gbit", default="25", help="relay -> engines rate, Gbit/s")
    pl.add_argument("--no-relay", action="store_true", help="engines pull from the origin")
    pl.add_argument(
        "--bench",
        default=None,
        help="codec figures from `delta-sync bench --json` (default: a 2-core dev machine's)",
    )
    pl.add_argument("--composer2", action="store_true", help="the 1 TB four-region scenario")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.set_defaults(fn=cmd_plan)
