"""Every GPU-only check of tandem in one prepared run, each step under its own time limit.

GPU time is scarce, so the run is planned to the second: the
environment from the README's command (CUDA torch from the package index, cupy from the
`gpu` extra), then the `gpu`-marked tests of each package, then the GPU sections of the
benchmarks; each step is killed at its limit so that one hang does not cost the rest, and
the limits add up to at most `BUDGET_S`. One summary file (a Markdown table: result,
seconds and key figures per check, the versions and the `nvidia-smi` line, the output tail
of every check that failed) is written into $OUT and printed.

`--dry-run` rehearses the same plan on a CPU with no device call: each test step collects
its tests (and must find the test files it names), each benchmark must answer `--help` with
its `--gpu` option, and the summary is written and read back. The default test suite runs
it, so the script cannot rot between GPU runs. Checks whose code has not landed (the vLLM
engine's GPU wiring: R3 from its routed experts and its batch-invariant mode, with their
tests in `VLLM_GPU_TESTS`) are listed as not available, and join the plan by themselves
once their files exist.

Only the standard library (of Python 3.9 or later) is used here: this runs before the
environment exists, with whatever `python3` the machine has.

    scripts/gpu_check.sh [--dry-run] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import gpu_check_report as report

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 480  # 8 minutes in all: a short stay on a GPU machine still leaves room for a rerun
DRY_LIMIT_S = 180  # each rehearsal step (they run at once on a CPU that may be busy)
VLLM_GPU_TESTS = "packages/orchestrator/tests/test_vllm_gpu.py"
ENGINES_BENCH = "benchmarks/engines.py"
UV = "(command -v uv >/dev/null || python3 -m pip install -q uv)"  # as the README says
SYNC = ["uv", "sync", "--all-packages", "--all-extras"]


@dataclass
class Step:
    """One check: its command on the device, its rehearsal on a CPU, and its limit."""

    name: str
    limit_s: int
    what: str
    device: list[str]  # run with the environment's python as "{py}"
    dry: list[str] | None = None  # None: nothing to rehearse beyond `needs`
    needs: list[str] = field(default_factory=list)  # files that must exist
    must_collect: list[str] = field(default_factory=list)  # test files a test step must collect
    missing: str = ""  # set when the check's code has not landed


def _pytest(paths: list[str], *extra: str) -> list[str]:
    return ["{py}", "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", *extra, *paths]


def _tests(name: str, limit: int, what: str, root: str, files: list[str], repo: Path) -> Step:
    """The `gpu` tests of one package: the files named here and every test_gpu*.py, so that
    the device imports no other test module (the rehearsal checks none holds a gpu test)."""
    named = [f"{root}/{f}" for f in files]
    found = [str(p.relative_to(repo)) for p in (repo / root).glob("test_gpu*.py")]
    run = sorted({*named, *found})
    return Step(
        name,
        limit,
        what,
        device=_pytest(run, "-rs"),
        dry=_pytest(run, "--collect-only"),
        needs=[root],
        must_collect=named,
    )


def stray_gpu_tests(step: Step, repo: Path) -> list[str]:
    """Test files of the step's package with a `gpu` mark that the step does not run (the
    vLLM GPU tests have a step of their own)."""
    runs = {*step.device, VLLM_GPU_TESTS}
    return sorted(
        str(p.relative_to(repo))
        for p in (repo / step.needs[0]).glob("test_*.py")
        if str(p.relative_to(repo)) not in runs and "mark.gpu" in p.read_text(errors="replace")
    )


def _bench(
    name: str, limit: int, what: str, script: str, *args: str, needs: list[str] | None = None
) -> Step:
    return Step(
        name,
        limit,
        what,
        device=["{py}", script, "--gpu", *args],
        dry=["{py}", script, "--help"],
        needs=[script, *(needs or [])],
    )


def plan(root: Path = ROOT) -> list[Step]:
    """The checks in the order they run; limits add up to at most BUDGET_S."""
    steps = [
        Step(
            "env",
            150,
            "uv environment: CUDA torch from the index, cupy (gpu extra); torch sees the GPU",
            device=[
                *([] if os.environ.get("PYTHON") else [UV, "&&", *SYNC, "&&"]),
                *("{py}", "scripts/gpu_check_probe.py", "--need-cuda"),
            ],  # PYTHON: an environment made beforehand (no package index needed)
            dry=["{py}", "scripts/gpu_check_probe.py", "--no-device"],
            needs=["pyproject.toml", "scripts/gpu_check_probe.py"],
        ),
        _tests(
            "tests:moe-determinism",
            55,
            "Triton kernels compile; bitwise batch-invariant across batch sizes, positions "
            "and CUDA streams (fp32, bf16); the model's decode equals its scoring",
            "packages/moe-determinism/tests",
            ["test_triton_kernels.py", "test_gpu_kernels.py"],
            root,
        ),
        _tests(
            "tests:delta-sync",
            55,
            "CUDA diff/patch (torch and cupy kernels, DLPack arrays) bit-exact vs the CPU path",
            "packages/delta-sync/tests",
            ["test_gpu.py", "test_gpu_cupy.py"],
            root,
        ),
        _tests(
            "tests:orchestrator",
            60,
            "engine == trainer log-probs bit for bit on CUDA (demo's model); a 2-step RL run "
            "on the GPU trains and publishes",
            "packages/orchestrator/tests",
            ["test_gpu_engine.py"],
            root,
        ),
        _bench(
            "bench:determinism",
            50,
            "compiled Triton kernels vs cuBLAS/SDPA: invariance and time ratios",
            "benchmarks/determinism.py",
        ),
        _bench(
            "bench:delta-sync",
            45,
            "encode/apply GB/s on the GPU per path (torch, cupy) vs the CPU, bit-exact",
            "benchmarks/delta_sync.py",
            "--mb",
            "64",
        ),
        _bench(
            "bench:engines",
            35,
            "embedded vs vLLM engine on the GPU: log-prob gap, routing agreement (R3, "
            "VLLM_BATCH_INVARIANT=1)",
            ENGINES_BENCH,
            needs=[VLLM_GPU_TESTS],
        ),
        Step(
            "tests:vllm",
            30,
            "vLLM with R3 and batch-invariant mode: log-prob gap and routing agreement 0",
            device=_pytest([VLLM_GPU_TESTS], "-rs"),
            dry=_pytest([VLLM_GPU_TESTS], "--collect-only"),
            needs=[VLLM_GPU_TESTS],
        ),
    ]
    for step in steps:
        absent = [n for n in step.needs if not (root / n).exists()]
        if absent:
            step.missing = f"not available: no {', '.join(absent)}"
    return steps


def python_of(root: Path, dry: bool) -> str:
    """The environment's interpreter: PYTHON if set, else .venv's (which the env step's
    `uv sync` makes on the device; a rehearsal without one uses this interpreter)."""
    if os.environ.get("PYTHON"):
        return os.environ["PYTHON"]
    venv = root / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() or not dry else sys.executable


@dataclass
class Outcome:
    status: str  # pass | fail | timeout | skip | not available | dry-run ok
    seconds: float
    output: str
    figures: str = ""


class Running:
    """A step's command in its own process group (a shell line when it holds "&&")."""

    def __init__(self, argv: list[str], cwd: Path) -> None:
        shell = "&&" in argv
        self.t0 = time.monotonic()
        self.outcome: Outcome | None = None  # steps sharing one process read it once
        self.proc = subprocess.Popen(
            " ".join(argv) if shell else argv,
            shell=shell,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

    def _drain(self) -> str:
        """What the killed step printed; a grandchild that left the group and still holds
        the pipe gets 2 s, then the pipe is closed on it."""
        try:
            out, _ = self.proc.communicate(timeout=2)
        except subprocess.TimeoutExpired as e:
            out = e.output or ""
            self.proc.stdout.close()
            self.proc.wait()
        return out.decode(errors="replace") if isinstance(out, bytes) else out

    def finish(self, limit_s: float, log: Path | None) -> Outcome:
        """Its outcome; the whole group is killed at ``limit_s`` from its start."""
        if self.outcome is None:
            left = max(limit_s - (time.monotonic() - self.t0), 0.1)
            try:
                out, _ = self.proc.communicate(timeout=left)
                status = "pass" if self.proc.returncode == 0 else "fail"
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                out, status = self._drain(), "timeout"
            self.outcome = Outcome(status, time.monotonic() - self.t0, out or "")
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text(self.outcome.output)
        return Outcome(self.outcome.status, self.outcome.seconds, self.outcome.output)


def check_dry(step: Step, outcome: Outcome, root: Path) -> Outcome:
    """A rehearsal passes when its command ran and found what the device run will use."""
    if outcome.status != "pass":
        return outcome
    if step.must_collect:
        ids = [i for i in report.collected(outcome.output) if i.startswith(step.needs[0] + "/")]
        files = sorted({i.split("::", 1)[0] for i in ids})
        lost = [f for f in step.must_collect if f not in files]
        stray = stray_gpu_tests(step, root)
        if not ids or lost or stray:
            outcome.status = "fail"
            outcome.figures = (
                f"gpu tests outside the plan: {', '.join(stray)}"
                if stray
                else f"not collected: {', '.join(lost) or 'any gpu test'}"
            )
            return outcome
        outcome.figures = f"{len(ids)} gpu tests collected in {len(files)} files"
    elif step.name.startswith("bench:"):
        if "--gpu" not in outcome.output:
            outcome.status = "fail"
            outcome.figures = f"{step.dry[1] if step.dry else step.name} has no --gpu option"
            return outcome
        outcome.figures = "--gpu option present"
    else:
        outcome.figures = report.figures_of(step.name, outcome.output)
    outcome.status = "dry-run ok"
    return outcome


def run_plan(
    steps: list[Step],
    *,
    dry: bool,
    root: Path,
    out: Path,
    budget_s: float = BUDGET_S,
    echo: Callable[[str], None] = print,
) -> list[tuple[Step, Outcome]]:
    """Each step under min(its limit, what is left of the budget). On the device the steps
    run one after another (they share the GPU); a rehearsal starts them all at once, as
    none of them touches a device, and each keeps its own limit."""
    start = time.monotonic()
    started: dict[str, Running] = {}
    results = []

    def launch(step: Step, argv: list[str]) -> None:
        py = python_of(root, dry)
        echo(f"== {step.name} (limit {step.limit_s} s): {step.what}")
        started[step.name] = Running([py if a == "{py}" else a for a in argv], root)

    if dry:  # the test steps' collections in one pytest process: one torch import, not one each
        tests = [s for s in steps if not s.missing and s.dry is not None and s.must_collect]
        files = sorted({f for s in tests for f in s.dry if f.endswith(".py")})
        collect = _pytest(files, "--collect-only")
        for step in steps:
            if not step.missing and step.dry is not None:
                if step in tests:
                    step.dry = collect
                    if step is not tests[0]:
                        started[step.name] = started[tests[0].name]
                        continue
                launch(step, step.dry)
    no_env = False  # on the device, nothing runs without the environment and its GPU
    for step in steps:
        argv = step.dry if dry else step.device
        left = budget_s - (time.monotonic() - start)
        if step.missing or argv is None or no_env or (left < 1 and not dry):
            why = step.missing or (
                "nothing to rehearse" if argv is None
                else "the env step did not pass" if no_env
                else "no time left"
            )  # fmt: skip
            status = "not available" if step.missing else "skip"
            results.append((step, Outcome(status, 0.0, "", why)))
            continue
        if not dry:
            launch(step, argv)
        log = out / "logs" / f"{step.name.replace(':', '-')}.log"
        outcome = started[step.name].finish(DRY_LIMIT_S if dry else min(step.limit_s, left), log)
        if dry:
            outcome = check_dry(step, outcome, root)
        else:
            outcome.figures = report.figures_of(step.name, outcome.output)
            nothing_passed = "passed" not in outcome.figures  # every test skipped: no proof
            if step.name.startswith("tests:") and outcome.status == "pass" and nothing_passed:
                outcome.status = "skip"
        echo(f"   {step.name}: {outcome.status} in {outcome.seconds:.1f} s {outcome.figures}")
        results.append((step, outcome))
        no_env = not dry and step.name == "env" and outcome.status != "pass"
    return results


def nvidia_smi_line(dry: bool) -> str:
    if dry:
        return "none (dry run on a CPU stand-in; no device call)"
    if shutil.which("nvidia-smi") is None:
        return "nvidia-smi not found"
    query = "--query-gpu=name,driver_version,memory.total,compute_cap"
    proc = subprocess.run(
        ["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True
    )
    return (proc.stdout.strip() or proc.stderr.strip()).replace("\n", "; ")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="rehearse on a CPU: no device call")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "runs" / "gpu_check"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    results = run_plan(plan(), dry=args.dry_run, root=ROOT, out=out)
    env_output = "".join(o.output for s, o in results if s.name == "env")
    summary = report.Summary(
        mode="dry run (CPU stand-in, no device call)" if args.dry_run else "device",
        when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        seconds=time.monotonic() - t0,
        budget_s=BUDGET_S,
        gpu=nvidia_smi_line(args.dry_run),
        versions=report.versions_line(env_output),
        rows=[
            report.Row(s.name, o.status, o.seconds, s.limit_s, o.figures, s.what, o.output)
            for s, o in results
        ],
    )
    path = out / report.SUMMARY_FILE
    path.write_text(summary.render())
    text = path.read_text()
    print(text)
    parsed = report.read(text)  # what a reader of the file gets back
    if [r.check for r in parsed.rows] != [s.name for s, _ in results]:
        print(f"gpu_check: {path} does not read back", file=sys.stderr)
        return 1
    return 0 if parsed.ok else 1


if __name__ == "__main__":
    sys.exit(main())
