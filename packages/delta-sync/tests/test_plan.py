"""The planner: its delta size against real encodes, its link sharing and times against
hand computations, and `delta-sync plan` / `bench --json` on the command line."""

from __future__ import annotations

import json
import math

import ml_dtypes
import msgspec
import numpy as np
import pytest

from tandem.delta_sync import encode_delta
from tandem.delta_sync.cli import main
from tandem.delta_sync.plan import (
    GBIT,
    Codec,
    Region,
    Scenario,
    binary_entropy,
    delta_bytes,
    fair_shares,
    plan,
    transfer_ends,
    value_bits_from,
)


def _pair(changed: float, n: int = 1 << 20, seed: int = 0) -> tuple[dict, dict]:
    rng = np.random.default_rng(seed)
    base = {"w": (rng.standard_normal(n) * 0.02).astype(ml_dtypes.bfloat16)}
    new = {"w": base["w"].copy()}
    bits = new["w"].view(np.uint16)
    idx = np.flatnonzero(rng.random(n) < changed)
    bits[idx] += rng.choice(np.array([1, 1, 1, 2, 0xFFFF, 0xFFFF, 0xFFFE], np.uint16), idx.size)
    return base, new


def test_delta_size_at_one_changed_fraction_predicts_another() -> None:
    # calibrate the value bits on a 1% delta, predict 3%, compare with the real encode
    base, new = _pair(0.01)
    ratio = base["w"].nbytes / len(encode_delta(base, new))
    codec = Codec(1.0, 1.0, value_bits=value_bits_from(ratio, 0.01, 2))
    base3, new3 = _pair(0.03, seed=1)
    actual = len(encode_delta(base3, new3))
    r = [Region("r", 1, 1, 1)]
    s = Scenario(model_bytes=base3["w"].nbytes, regions=r, uplink_gbit=1, changed=0.03)
    assert abs(delta_bytes(s, codec) - actual) / actual < 0.1, (delta_bytes(s, codec), actual)


def test_binary_entropy_and_fair_shares_by_hand() -> None:
    assert binary_entropy(0.5) == 1.0 and binary_entropy(0.0) == 0.0
    assert math.isclose(binary_entropy(0.02), -(0.02 * math.log2(0.02) + 0.98 * math.log2(0.98)))
    assert fair_shares(10, [2, 8, 8]) == [2, 4, 4]  # the small flow keeps its demand
    assert fair_shares(10, [1, 2]) == [1, 2]  # room for both
    assert fair_shares(9, [9, 9, 9]) == [3, 3, 3]


def test_a_link_is_reshared_as_flows_start_and_finish() -> None:
    # 20 Mbit/s (2.5 MB/s) shared by two 0.84 MB flows starting at 0.15 s and 0.375 s: the
    # first has it alone for 0.225 s (0.5625 MB), then both get 1.25 MB/s until the first
    # is through (0.2775 MB more: 0.222 s), then the second has it alone again
    first = 0.375 + 0.2775e6 / 1.25e6
    second = first + (0.84e6 - 0.2775e6) / 2.5e6
    ends = transfer_ends(2.5e6, [6.25e6, 6.25e6], [0.15, 0.375], [0.84e6, 0.84e6])
    assert math.isclose(ends[0], first) and math.isclose(ends[1], second)
    assert transfer_ends(1.0, [0.5], [2.0], [1.0]) == [4.0]  # capped by its own link
    assert transfer_ends(1.0, [1.0], [3.0], [0.0]) == [3.0]  # nothing to send


def test_one_region_plan_by_hand() -> None:
    codec = Codec(encode_gbps_core=2.0, apply_gbps_core=1.0, value_bits=3.0)
    region = Region("eu", engines=2, rate_gbit=1.0, rtt_ms=100, relay=True, in_region_gbit=10)
    s = Scenario(
        model_bytes=8e9, regions=[region], uplink_gbit=10, changed=0.02, trainer_cores=4,
        engine_cores=16, shard_bytes=32 << 20, download_workers=8, store_gbit=25,
    )  # fmt: skip
    p = plan(s, codec)
    d = 4e9 * 0.02 * (binary_entropy(0.02) / 0.02 + 3.0) / 8
    assert math.isclose(p.delta_bytes, d)
    prepare = max(8e9 / 8e9, d / (25 * GBIT)) + 0.01  # 4 cores x 2 GB/s
    waves = math.ceil(math.ceil(d / (32 << 20)) / 8)
    # the held long-poll's answer (half a round trip), then a round trip per wave of shards
    fetch = 0.05 + waves * 0.1 + max(d / GBIT, 2 * d / (10 * GBIT))
    assert math.isclose(p.total_s, prepare + fetch + 0.5)  # apply: 8 GB at 16 x 1 GB/s
    assert p.bottleneck == "trainer encode" and p.uplink_bytes == d
    polled = plan(msgspec.structs.replace(s, long_poll=False), codec)  # latest+manifest: 1 rtt
    assert math.isclose(polled.total_s - p.total_s, 0.05)


def test_a_shared_uplink_is_the_bottleneck_and_relays_cut_its_bytes() -> None:
    codec = Codec(encode_gbps_core=10.0, apply_gbps_core=10.0)
    regions = [Region(f"r{i}", 4, 10.0, 50) for i in range(3)]
    s = Scenario(model_bytes=1e11, regions=regions, uplink_gbit=1.0, trainer_cores=64)
    relayed = plan(s, codec)
    no_relays = [Region(r.name, r.engines, r.rate_gbit, r.rtt_ms, relay=False) for r in regions]
    direct = plan(msgspec.structs.replace(s, regions=no_relays), codec)
    assert relayed.bottleneck == "origin uplink"
    assert math.isclose(direct.uplink_bytes, 4 * relayed.uplink_bytes)
    assert direct.total_s > 3 * relayed.total_s


def test_plan_command_prints_the_step_and_the_composer2_scenario(capsys, tmp_path) -> None:
    args = ["plan", "--model-gb", "140", "--regions", "us,eu", "--engines", "4"]
    assert main([*args, "--rate-gbit", "5,2", "--rtt-ms", "20,150"]) == 0
    out = capsys.readouterr().out
    assert "time to every engine" in out and "bottleneck" in out and " eu " in out
    totals = []
    for extra in ([], ["--polling"]):  # polling engines: eu's manifest half a round trip later
        assert main([*args, "--rate-gbit", "5,2", "--rtt-ms", "20,150", "--json", *extra]) == 0
        totals.append(json.loads(capsys.readouterr().out)["plan"]["total_s"])
    assert math.isclose(totals[1] - totals[0], 0.075)
    assert main(["plan", "--composer2"]) == 0
    out = capsys.readouterr().out
    assert "public figures" in out and "1,000.0 GB" in out and "four" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--regions", "a,b", "--rtt-ms", "1,2,3"], "--rtt-ms: expected 1 or 2"),
        (["--changed", "1.5"], "--changed must be a fraction"),
        (["--bench", "/nonexistent.json"], "no such file"),
        (["--checkpoint", "/nonexistent"], "no .safetensors files"),
    ],
)
def test_plan_refuses_bad_input_in_one_line(args, message, capsys) -> None:
    assert main(["plan", *args]) == 1
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_bench_json_feeds_the_planner(tmp_path, capsys) -> None:
    path = tmp_path / "codec.json"
    bench = ["bench", "--mb", "2", "--lrs", "2e-6", "--repeat", "1", "--workers", "2"]
    assert main([*bench, "--json", str(path)]) == 0
    row = json.loads(path.read_text())["rows"][0]
    assert row["encode_cpu"] > 0 and row["ratio"] > 10
    capsys.readouterr()
    assert main(["plan", "--bench", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert math.isclose(data["codec"]["encode_gbps_core"], row["encode_cpu"])
    assert data["plan"]["total_s"] > 0
