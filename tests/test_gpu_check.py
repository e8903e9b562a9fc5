"""scripts/gpu_check.sh, rehearsed on a CPU so that it cannot rot between GPU runs.

The dry run goes through the same plan and runner as a GPU run, with no device call; the
runner's limits, the budget and the summary file are checked here with small commands.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gc():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_check

        yield gpu_check
    finally:
        sys.path.remove(str(ROOT / "scripts"))


@pytest.fixture(autouse=True)
def _this_python(monkeypatch) -> None:
    """Stand-in steps run with this interpreter (a tmp_path root has no .venv)."""
    monkeypatch.setenv("PYTHON", sys.executable)


def test_dry_run_rehearses_every_check_and_its_summary_reads_back(gc, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"} | {"OUT": str(tmp_path)}
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run"],
        env=env, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    text = (tmp_path / gc.report.SUMMARY_FILE).read_text()
    assert text in proc.stdout  # printed as written
    summary = gc.report.read(text)
    assert summary.verdict == "DRY RUN OK" and summary.mode.startswith("dry run")
    planned = gc.plan()
    assert [r.check for r in summary.rows] == [s.name for s in planned]
    for step, row in zip(planned, summary.rows, strict=True):
        if step.missing:
            assert row.status == "not available" and "no " in row.figures
        else:
            assert row.status == "dry-run ok", row
    rows = {r.check: r for r in summary.rows}
    for name in ("tests:moe-determinism", "tests:delta-sync", "tests:orchestrator"):
        assert "gpu tests collected" in rows[name].figures
    engines = all((ROOT / f).exists() for f in (gc.ENGINES_BENCH, gc.VLLM_GPU_TESTS))
    assert (rows["bench:engines"].status == "not available") is not engines
    assert "torch" in summary.versions and summary.gpu.startswith("none (dry run")
    assert (tmp_path / "logs" / "tests-delta-sync.log").exists()


def test_the_limits_fit_the_device_budget(gc) -> None:
    steps = gc.plan()
    assert sum(s.limit_s for s in steps) <= gc.BUDGET_S <= 480
    assert all(s.limit_s > 0 for s in steps)
    # every check of the issue has a step, whether or not its code has landed yet
    assert {"env", "tests:moe-determinism", "tests:delta-sync", "tests:orchestrator",
            "bench:determinism", "bench:delta-sync", "bench:engines", "tests:vllm"} == {
        s.name for s in steps
    }  # fmt: skip


def test_the_env_step_syncs_unless_an_environment_is_given(gc, monkeypatch) -> None:
    monkeypatch.delenv("PYTHON")
    env = gc.plan()[0]
    assert env.name == "env" and " ".join(gc.SYNC) in " ".join(env.device)
    monkeypatch.setenv("PYTHON", "/opt/env/bin/python")
    assert gc.plan()[0].device == ["{py}", "scripts/gpu_check_probe.py", "--need-cuda"]


def test_a_missing_check_is_not_available_and_joins_once_its_files_exist(gc, tmp_path) -> None:
    bare = {s.name: s for s in gc.plan(tmp_path)}
    assert all(s.missing.startswith("not available") for s in bare.values())
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "engines.py").write_text("")
    assert {s.name: s for s in gc.plan(tmp_path)}["bench:engines"].missing  # GPU wiring too
    gpu_tests = tmp_path / gc.VLLM_GPU_TESTS
    gpu_tests.parent.mkdir(parents=True)
    gpu_tests.write_text("")
    joined = {s.name: s for s in gc.plan(tmp_path)}
    assert not joined["bench:engines"].missing and not joined["tests:vllm"].missing


def _step(gc, name: str, limit: int, code: str):
    return gc.Step(name, limit, "a stand-in", device=["{py}", "-c", code], dry=None)


def test_a_hang_is_killed_at_its_limit_and_the_next_step_still_runs(gc, tmp_path) -> None:
    marker = tmp_path / "late"
    child = tmp_path / "child.py"
    child.write_text(f"import time\ntime.sleep(1.5)\nopen({str(marker)!r}, 'w').close()\n")
    # a child that outlives its parent unless the whole process group is killed
    hang = f"import subprocess, sys, time; subprocess.Popen([sys.executable, {str(child)!r}]); time.sleep(60)"
    steps = [
        _step(gc, "tests:hang", 1, hang),
        _step(gc, "bench:ok", 20, "print('gpu_check: 3.5 GB/s')"),
        _step(gc, "bench:fails", 20, "raise SystemExit(3)"),
    ]
    t0 = time.monotonic()
    results = gc.run_plan(steps, dry=False, root=tmp_path, out=tmp_path, echo=lambda s: None)
    assert [o.status for _, o in results] == ["timeout", "pass", "fail"]
    assert results[1][1].figures == "3.5 GB/s"
    assert results[0][1].seconds < 10 and time.monotonic() - t0 < 30
    time.sleep(2.0)
    assert not marker.exists()  # the hung step's child was killed with it


def test_a_process_that_left_the_group_cannot_hold_the_step_open(gc, tmp_path) -> None:
    pid_file = tmp_path / "pid"
    escape = (
        "import os, sys, time\n"
        "if os.fork() == 0:\n"  # keeps the step's stdout open, in a session of its own
        f"    os.setsid(); open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)\n"
        "time.sleep(60)\n"
    )
    t0 = time.monotonic()
    ((_, outcome),) = gc.run_plan(
        [_step(gc, "tests:escape", 1, escape)], dry=False, root=tmp_path, out=tmp_path,
        echo=lambda s: None,
    )  # fmt: skip
    try:
        assert outcome.status == "timeout" and time.monotonic() - t0 < 15
    finally:
        os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_a_spent_budget_skips_what_is_left(gc, tmp_path) -> None:
    steps = [_step(gc, "bench:slow", 20, "import time; time.sleep(30)"), _step(gc, "b", 20, "")]
    results = gc.run_plan(
        steps, dry=False, root=tmp_path, out=tmp_path, budget_s=1.5, echo=lambda s: None
    )
    assert [o.status for _, o in results] == ["timeout", "skip"]
    assert results[1][1].figures == "no time left"


def test_without_the_environment_nothing_else_runs_on_the_device(gc, tmp_path) -> None:
    steps = [_step(gc, "env", 20, "raise SystemExit('no CUDA')"), _step(gc, "tests:a", 20, "")]
    results = gc.run_plan(steps, dry=False, root=tmp_path, out=tmp_path, echo=lambda s: None)
    assert [(o.status, o.figures) for _, o in results] == [
        ("fail", ""),
        ("skip", "the env step did not pass"),
    ]


def test_tests_that_all_skipped_on_the_device_prove_nothing(gc, tmp_path) -> None:
    steps = [_step(gc, "tests:x", 20, "print('3 skipped in 0.5s')")]
    ((_, outcome),) = gc.run_plan(
        steps, dry=False, root=tmp_path, out=tmp_path, echo=lambda s: None
    )
    assert outcome.status == "skip" and outcome.figures == "3 skipped"


def test_a_rehearsal_fails_when_a_gpu_test_file_is_left_out(gc, tmp_path) -> None:
    step = gc.Step(
        "tests:p", 10, "", device=[], dry=[], needs=["pkg/tests"],
        must_collect=["pkg/tests/test_gpu_a.py", "pkg/tests/test_gpu_b.py"],
    )  # fmt: skip
    out = "pkg/tests/test_gpu_a.py::test_one\npkg/tests/test_gpu_a.py::test_two[x]\n\n2 tests"
    got = gc.check_dry(step, gc.Outcome("pass", 1.0, out), ROOT)
    assert got.status == "fail" and got.figures == "not collected: pkg/tests/test_gpu_b.py"
    out += "\npkg/tests/test_gpu_b.py::test_three"
    got = gc.check_dry(step, gc.Outcome("pass", 1.0, out), ROOT)
    assert got.status == "dry-run ok" and got.figures == "3 gpu tests collected in 2 files"
    tests = tmp_path / "pkg" / "tests"
    tests.mkdir(parents=True)
    (tests / "test_other.py").write_text("import pytest\n@pytest.mark.gpu\ndef test_x(): ...\n")
    got = gc.check_dry(step, gc.Outcome("pass", 1.0, out), tmp_path)
    assert got.status == "fail"
    assert got.figures == "gpu tests outside the plan: pkg/tests/test_other.py"
    bench = gc.Step("bench:b", 10, "", device=[], dry=["py", "b.py", "--help"])
    got = gc.check_dry(bench, gc.Outcome("pass", 1.0, "usage: b.py [-h]"), ROOT)
    assert got.status == "fail" and "no --gpu option" in got.figures


def test_figures_are_taken_from_each_kind_of_output(gc) -> None:
    figures = gc.report.figures_of
    pytest_out = "SKIPPED [1] a.py:3: cupy (the gpu extra) is not installed\n==== 4 passed, 1 skipped in 2.1s ===="
    assert figures("tests:a", pytest_out) == (
        "4 passed, 1 skipped; cupy (the gpu extra) is not installed"
    )
    assert figures("tests:a", "= 1 failed, 2 passed in 3s =") == "1 failed, 2 passed"
    table = "\n".join(
        [
            f"{'matmul [m,4096]x[4096,4096]':34}{'float32':>10}{'True':>11}{0.5:>10.3f}{0.6:>11.3f}{1.2:>7.2f}x",
            f"{'attention decode 8x32x1x1024':34}{'bfloat16':>10}{'':>11}{0.1:>10.3f}{0.25:>11.3f}{2.5:>7.2f}x",
            f"{'rms_norm [m,4096]':34}{'bfloat16':>10}{'False':>11}{0.1:>10.3f}{0.1:>11.3f}{1.0:>7.2f}x",
        ]
    )  # as benchmarks/determinism.py --gpu prints its rows
    assert figures("bench:determinism", table) == (
        "bitwise invariant 1/2; triton/stock time 1.00x-2.50x "
        "(slowest: attention decode 8x32x1x1024 bfloat16)"
    )
    assert figures("bench:x", "noise\ngpu_check: a=1\ngpu_check: b=2") == "a=1; b=2"
    line = 'gpu_check_versions: {"torch": "2.14.0", "cupy": "not installed"}'
    assert gc.report.versions_line("uv output\n" + line) == "torch 2.14.0, cupy not installed"


def test_a_failed_summary_says_so_and_keeps_the_tail_of_the_output(gc) -> None:
    r = gc.report
    rows = [
        r.Row("env", "pass", 40.0, 150, "torch sees 1 CUDA device(s)", "env", "ok"),
        r.Row("tests:x", "timeout", 55.0, 55, "", "x", "\n".join(f"line {i}" for i in range(100))),
    ]
    s = r.Summary(
        "device", "2026-01-01 00:00 UTC", 95.0, 480, "NVIDIA H200, 570.1", "torch 2", rows
    )
    text = s.render()
    back = r.read(text)
    assert back.verdict == "FAIL" and [x.status for x in back.rows] == ["pass", "timeout"]
    assert back.gpu == "NVIDIA H200, 570.1" and back.seconds == 95.0
    assert "line 99" in text and "line 59" not in text  # the last 40 lines
    with pytest.raises(ValueError, match="title says PASS"):
        r.read(text.replace("GPU check: FAIL", "GPU check: PASS"))
    with pytest.raises(ValueError, match="not a tandem GPU check summary"):
        r.read("# something else\n")
