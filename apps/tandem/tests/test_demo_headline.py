"""The demo report's headline: the paired lift interval, the README band, cut-short notes and
the machine line."""

from __future__ import annotations

import math
import random
import statistics
from pathlib import Path

import msgspec
import pytest

from tandem.app.cli import main
from tandem.app.demo_report import headline_rows
from tandem.app.headline import band_line, paired_lift
from tandem.app.machine import Machine, machine_line, parse_cpuinfo, this_machine
from tandem.app.pipeline_config import DemoSettings, PipelineConfig
from tandem.orchestrator import EvalResult


def _result(outcomes: list[list[bool]]) -> EvalResult:
    """An evaluation whose task i resolved ``outcomes[i]`` (one bool per sample)."""
    n = len(outcomes)
    s = len(outcomes[0])
    solved = [sum(o) for o in outcomes]
    return EvalResult(
        tasks=n,
        samples_per_task=s,
        pass_at={1: sum(solved) / (n * s)},
        mean_reward=0.0,
        format_error_rate=0.0,
        mean_turns=3.0,
        infra_faults=0,
        solved=solved,
    )


def _outcomes(rng: random.Random, rates: list[float], samples: int) -> list[list[bool]]:
    return [[rng.random() < p for _ in range(samples)] for p in rates]


def test_paired_interval_matches_an_independent_computation() -> None:
    rng = random.Random(7)
    rates = [rng.random() for _ in range(40)]
    before = _outcomes(rng, rates, 4)
    after = _outcomes(rng, [min(1.0, p + 0.2) for p in rates], 4)
    lift = paired_lift(_result(before), _result(after))
    # independently: each task's rate from its raw outcomes, via the statistics module
    diffs = [statistics.fmean(a) - statistics.fmean(b) for a, b in zip(after, before, strict=True)]
    se = statistics.stdev(diffs) / math.sqrt(len(diffs))
    assert lift.points == pytest.approx(100 * statistics.fmean(diffs), abs=1e-9)
    assert lift.se == pytest.approx(100 * se, rel=1e-9)
    assert lift.low == pytest.approx(100 * (statistics.fmean(diffs) - 1.96 * se), abs=1e-9)
    assert lift.high == pytest.approx(100 * (statistics.fmean(diffs) + 1.96 * se), abs=1e-9)
    # pairing: far narrower than two independent means' interval would be on shared tasks
    unpaired = math.hypot(
        statistics.stdev(statistics.fmean(t) for t in after),
        statistics.stdev(statistics.fmean(t) for t in before),
    ) / math.sqrt(len(diffs))
    assert lift.se < 100 * unpaired


def test_paired_interval_by_hand() -> None:
    # per-task differences 0.5, 0.0, 0.25, 0.25: mean 0.25, sd sqrt(1/24), n 4
    before = [[0, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 1], [1, 0, 0, 0]]
    after = [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0]]
    lift = paired_lift(
        _result([list(map(bool, t)) for t in before]), _result([list(map(bool, t)) for t in after])
    )
    assert lift.points == pytest.approx(25.0)
    assert lift.se == pytest.approx(100 * math.sqrt(1 / 24) / 2)
    assert (lift.before, lift.after) == (pytest.approx(0.25), pytest.approx(0.5))


def test_band_line_says_plainly_when_the_lift_is_outside() -> None:
    # three of four tasks gain one sample in four: +18.75 points
    before = [[True, False, False, False]] * 4
    after = [[True, True, False, False]] * 3 + [[True, False, False, False]]
    lift = paired_lift(_result(before), _result(after))
    assert band_line(lift, (15.2, 19.1)).startswith("within the README's band")
    below = band_line(lift, (20.0, 25.0))
    assert below.startswith("OUTSIDE") and "1.2 points below" in below
    above = band_line(lift, (5.0, 10.0))
    assert above.startswith("OUTSIDE") and "8.8 points above" in above


def _config(**demo: float) -> PipelineConfig:
    config = PipelineConfig(demo=DemoSettings(**demo))
    rl = msgspec.structs.replace(config.rl, steps=30)
    mid = msgspec.structs.replace(config.midtrain, steps=400)
    return msgspec.structs.replace(config, rl=rl, midtrain=mid)


def test_a_capped_stage_is_named_in_the_first_rows() -> None:
    before = _result([[True, False, False, False]] * 4)
    after = _result([[True, True, False, False]] * 4)
    rows = headline_rows(_config(time_cap_s=600), before, after, rl_steps=12, midtrain_steps=400)
    assert rows[0] == (
        "NOTE",
        "RL CUT SHORT by the time cap (demo.time_cap_s = 600 s): 12 of 30 steps; "
        "this run's figures are not the fixed-work demo's",
    )
    assert rows[1][0] == "held-out pass@1 lift, paired by task"
    rows = headline_rows(
        _config(time_cap_s=600, midtrain_cap_s=200), before, after, rl_steps=30, midtrain_steps=250
    )
    assert rows[0][1].startswith(
        "mid-training CUT SHORT by the time cap (demo.midtrain_cap_s = 200 s)"
    )
    assert "250 of 400 steps" in rows[0][1]
    assert rows[1][0] != "NOTE"


def test_uncapped_full_run_has_no_note_and_an_early_end_is_not_blamed_on_a_cap() -> None:
    before, after = _result([[True, False]] * 3), _result([[True, True]] * 2 + [[False, True]])
    rows = headline_rows(_config(), before, after, rl_steps=30, midtrain_steps=400)
    assert [r[0] for r in rows] == [
        "held-out pass@1 lift, paired by task",
        "compared with the README",
        "categories that lost more than 10 points",
    ]
    assert rows[2][1].startswith("n/a")  # these results carry no task categories
    rows = headline_rows(_config(), before, after, rl_steps=20, midtrain_steps=400)
    assert rows[0] == ("NOTE", "RL ended early: 20 of 30 steps (the log says why)")


CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu vme sse2 avx avx2 fma avx512f avx512dq avx512_bf16 avx512_vnni

processor\t: 1
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu vme sse2 avx avx2 fma avx512f avx512dq avx512_bf16 avx512_vnni
"""


def test_cpu_line_names_model_flags_cores_and_threads(tmp_path: Path) -> None:
    assert parse_cpuinfo(CPUINFO) == (
        "AMD EPYC 9R14 96-Core Processor",
        ("avx2", "avx512f", "avx512_bf16"),
    )
    assert parse_cpuinfo("processor\t: 0\nflags\t: sse2 avx\n") == (None, ())
    line = machine_line(
        Machine(cpu="AMD EPYC 9R14 96-Core Processor", flags=("avx2",), cores=2),
        (("mid-training/eval", 2), ("RL", 1)),
    )
    assert (
        line
        == "AMD EPYC 9R14 96-Core Processor (avx2), 2 cores; torch threads: 2 mid-training/eval, 1 RL"
    )
    assert "no AVX2/AVX-512/AMX" in machine_line(Machine(cpu="x", flags=(), cores=1), ())
    info = tmp_path / "cpuinfo"
    info.write_text(CPUINFO)
    here = this_machine(info)
    assert (here.cpu, here.flags) == (
        "AMD EPYC 9R14 96-Core Processor",
        ("avx2", "avx512f", "avx512_bf16"),
    )
    assert here.cores >= 1


def test_cpu_model_falls_back_to_platform_without_cpuinfo(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr("platform.processor", lambda: "Some CPU")
    assert this_machine(tmp_path / "absent").cpu == "Some CPU"
    assert this_machine(tmp_path / "absent").flags == ()


def test_demo_caps_are_off_by_default_and_negative_ones_are_rejected(capsys) -> None:
    assert DemoSettings().midtrain_cap() is None
    assert DemoSettings(time_cap_s=700).midtrain_cap() == 700
    assert DemoSettings(time_cap_s=700, midtrain_cap_s=300).midtrain_cap() == 300
    assert main(["demo", "--set", "demo.time_cap_s=-1", "--dump-config"]) == 2
    err = capsys.readouterr().err
    assert "time_cap_s" in err or "time caps" in err
    assert "Traceback" not in err
