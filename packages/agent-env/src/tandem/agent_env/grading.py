"""Reward from hidden tests, run in a fresh sandbox over the episode's final workspace.

The sandbox is usually a job of the runtime's fork server (``sandbox/forkserver_client.py``: a
fork of a long-lived sandbox with ``unittest`` imported, in fresh namespaces and its own
cgroup), else a one-shot bwrap run.

The grading sandbox stacks three read-only layers: the task's base, the episode's writes, and
the hidden tests (plus pristine copies of reset paths and of files that act on the test
machinery, ``collection_guard.py``) on top, so whatever the agent did to those files is undone.
Writes during grading go to a throwaway layer in RAM. The verdict is the judge's
(``judge.py``): it reads what the test process reports as bounded, schema-checked data. A
grading run that never started (the sandbox or the interpreter failed before any of the agent's
code ran) is an infrastructure fault: the episode is marked, not scored 0.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import msgspec
import structlog

from tandem.agent_env.collection_guard import guard
from tandem.agent_env.judge import Reported, Verdict, judge, read_records, record_budget
from tandem.agent_env.sandbox import bwrap as bw
from tandem.agent_env.sandbox.forkserver_client import ForkServerError
from tandem.agent_env.sandbox.proc import reap, spawn
from tandem.agent_env.sandbox.rootless import rootless_limits
from tandem.agent_env.sandbox.runtime import Runtime
from tandem.agent_env.sandbox.session import Session
from tandem.agent_env.task import Task

log = structlog.get_logger()


class GradeResult(msgspec.Struct, frozen=True):
    """Verdict of the hidden tests; ``reward`` is None when grading hit an infra fault."""

    reward: float | None
    resolved: bool
    tests: dict[str, str]
    infra_fault: bool = False
    detail: str = ""
    seconds: float = 0.0


def score(task: Task, tests: dict[str, str], partial_credit: bool) -> tuple[float, bool]:
    """SWE-bench rule: resolved iff every fail-to-pass and pass-to-pass test passes."""
    wanted = [*task.hidden_tests.fail_to_pass, *task.hidden_tests.pass_to_pass]
    passed = sum(tests.get(t) == "passed" for t in wanted)
    resolved = bool(wanted) and passed == len(wanted)
    if partial_credit and wanted:
        return passed / len(wanted), resolved
    return (1.0 if resolved else 0.0), resolved


def _spec(runtime: Runtime, task: Task, session: Session, hidden: Path) -> dict[str, Any]:
    """What the test runner is told: the classic test ids, the cases (without their expected
    values), and for classic tests the guarded paths to remove and the hidden files' hashes."""
    cases = {c.id for c in task.hidden_tests.cases}
    wanted = [*task.hidden_tests.fail_to_pass, *task.hidden_tests.pass_to_pass]
    spec: dict[str, Any] = {
        "ids": [t for t in dict.fromkeys(wanted) if t not in cases],
        "cases": [
            {"id": c.id, "imports": c.imports, "expr": c.expr} for c in task.hidden_tests.cases
        ],
        "framework": task.hidden_tests.framework,
        "paths": list(runtime.config.python_paths),
    }
    if spec["ids"]:  # test files are imported: what the agent wrote must not change that
        spec["seal"] = secrets.token_hex(16)  # their records count only with it (judge.py)
        writes = session.final_layers()[-1]
        if runtime.mounts is not None:  # the episode's disk is mounted in the helper's view
            writes = runtime.mounts.view(writes)
        spec["remove"], spec["hashes"] = guard(Path(writes), session.base, hidden, task)
    return spec


async def grade(
    runtime: Runtime, task: Task, session: Session, timeout_s: float, partial_credit: bool
) -> GradeResult:
    """Run the hidden tests over the episode's final workspace: in a job of the runtime's
    fork server when it can serve the task (sandboxed, ``unittest``, layers it can see), else
    in a one-shot sandbox. A fork-server problem falls back to the one-shot sandbox; a run
    that never started there either is an infrastructure fault."""
    t0 = time.monotonic()
    hidden = runtime.hidden_layer(task, session.base, session.dir / "hidden")
    ids = list(dict.fromkeys([*task.hidden_tests.fail_to_pass, *task.hidden_tests.pass_to_pass]))
    spec = _spec(runtime, task, session, hidden)
    budget = record_budget(task)
    server = runtime.forkserver if task.hidden_tests.framework == "unittest" else None
    if server is not None:
        lowers = [server.layer_path(p) for p in [hidden, *reversed(session.final_layers())]]
        if all(lowers):
            try:
                out = await server.grade([str(p) for p in lowers], spec, timeout_s, budget)
            except ForkServerError as e:
                log.warning("agent_env.forkserver_grade_failed", task=task.id, error=str(e))
            else:
                verdict = judge(task, ids, out.reported, seal=spec.get("seal", ""))
                if not verdict.infra and not out.server_died:
                    return _result(task, verdict, partial_credit, t0)
                log.warning(
                    "agent_env.forkserver_grade_fault",
                    task=task.id,
                    server_died=out.server_died,
                    error=verdict.infra or "the fork server died",
                )

    reported, stderr, error = await _grade_one_shot(
        runtime, session, hidden, spec, timeout_s, task.hidden_tests.framework, budget
    )
    if error:
        return GradeResult(None, False, {}, True, error, time.monotonic() - t0)
    verdict = judge(task, ids, reported, stderr, seal=spec.get("seal", ""))
    return _result(task, verdict, partial_credit, t0)


def _result(task: Task, verdict: Verdict, partial_credit: bool, t0: float) -> GradeResult:
    seconds = time.monotonic() - t0
    if verdict.infra:
        return GradeResult(None, False, {}, True, verdict.infra, seconds)
    reward, resolved = score(task, verdict.tests, partial_credit)
    return GradeResult(reward, resolved, verdict.tests, False, verdict.detail, seconds)


async def _grade_one_shot(
    runtime: Runtime,
    session: Session,
    hidden: Path,
    spec: dict[str, Any],
    timeout_s: float,
    framework: str,
    budget: int,
) -> tuple[Reported, str, str]:
    """A fresh sandbox (or, unsandboxed, a copied tree) running the test runner once:
    (what it reported, stderr tail, error that kept it from starting)."""
    # unittest needs only the standard library: skip site-packages (and its .pth files) then
    flags = ("-I", "-S") if framework == "unittest" else ("-I",)
    cgroup = None
    spec = dict(spec)
    reported = Reported(budget)
    if runtime.sandboxed:
        assert runtime.cgroups is not None
        lim = runtime.config.limits
        mem = lim.memory_bytes + lim.disk_bytes + lim.tmp_bytes
        cgroup = await asyncio.to_thread(runtime.cgroups.create, mem, lim.pids)
        spec["workspace"] = bw.WORKSPACE
        spec["rlimits"] = {
            "fsize": lim.file_size_bytes,
            "nofile": lim.open_files,
            **rootless_limits(runtime, lim),  # memory and processes, without cgroups
        }
        argv = runtime.base_argv + bw.workspace_args(
            [*session.final_layers(), str(hidden)], None, None
        )
        argv += bw.tool_argv(runtime.config.python, "runner", bw.TOOLS_MOUNT, flags)
    else:
        tree = session.dir / "grade"
        await asyncio.to_thread(shutil.copytree, session.final_layers()[0], tree, symlinks=True)
        await asyncio.to_thread(shutil.copytree, hidden, tree, symlinks=True, dirs_exist_ok=True)
        spec["workspace"] = str(tree)
        argv = bw.tool_argv(runtime.config.python, "runner", str(bw.INSIDE_DIR), flags)
    try:  # the spec goes on stdin: its seal must not be readable in the process's argv
        proc = await spawn(argv, cgroup, subprocess.PIPE, True, seccomp=runtime.seccomp_file)
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(spec).encode())
        proc.stdin.close()
    except OSError as e:
        if cgroup is not None:
            await asyncio.to_thread(cgroup.remove)
        return reported, "", f"could not start grading: {e}"
    err_tail = bytearray()

    async def drain_stderr() -> None:
        assert proc.stderr is not None
        while chunk := await proc.stderr.read(1 << 16):
            err_tail.extend(chunk)
            del err_tail[:-4000]

    drainer = asyncio.create_task(drain_stderr())
    try:
        assert proc.stdout is not None
        await asyncio.wait_for(read_records(proc.stdout, reported), timeout_s)
    except TimeoutError:
        reported.timed_out = True
    finally:
        await reap(proc, cgroup)
        drainer.cancel()
        if not runtime.sandboxed:
            await asyncio.to_thread(shutil.rmtree, session.dir / "grade", True)
    return reported, err_tail.decode("utf-8", "replace"), ""
