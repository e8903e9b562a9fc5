"""Reward from hidden tests, run in a fresh sandbox over the episode's final workspace.

The sandbox is usually a job of the runtime's fork server (``sandbox/forkserver_client.py``: a
fork of a long-lived sandbox with ``unittest`` imported, in fresh namespaces and its own
cgroup), else a one-shot bwrap run.

The grading sandbox stacks three read-only layers: the task's base, the episode's writes, and
the hidden tests (plus pristine copies of reset paths) on top, so whatever the agent did to
those files is undone. Writes during grading go to a throwaway layer in RAM. A grading run
that never started (the sandbox or the interpreter failed) is an infrastructure fault: the
episode is marked, not scored 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import msgspec
import structlog

from tandem.agent_env.sandbox import bwrap as bw
from tandem.agent_env.sandbox.forkserver_client import ForkServerError
from tandem.agent_env.sandbox.proc import reap, spawn
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
    spec: dict[str, Any] = {
        "ids": ids,
        "framework": task.hidden_tests.framework,
        "paths": list(runtime.config.python_paths),
    }
    server = runtime.forkserver if task.hidden_tests.framework == "unittest" else None
    if server is not None:
        lowers = [server.layer_path(p) for p in [hidden, *reversed(session.final_layers())]]
        if all(lowers):
            try:
                out = await server.grade([str(p) for p in lowers], spec, timeout_s)
            except ForkServerError as e:
                log.warning("agent_env.forkserver_grade_failed", task=task.id, error=str(e))
            else:
                started = any(m.get("started") for m in out.messages)
                if started and not out.server_died:
                    return _verdict(task, ids, out.messages, out.timed_out, partial_credit, "", t0)
                fatal = [str(m["fatal"]) for m in out.messages if m.get("fatal")]
                log.warning(
                    "agent_env.forkserver_grade_fault",
                    task=task.id,
                    server_died=out.server_died,
                    error=(fatal or ["no test started"])[-1],
                )

    messages, timed_out, stderr, error = await _grade_one_shot(
        runtime, session, hidden, spec, timeout_s, task.hidden_tests.framework
    )
    if error:
        return GradeResult(None, False, {}, True, error, time.monotonic() - t0)
    return _verdict(task, ids, messages, timed_out, partial_credit, stderr, t0)


def _verdict(
    task: Task,
    ids: list[str],
    messages: list[dict[str, Any]],
    timed_out: bool,
    partial_credit: bool,
    stderr: str,
    t0: float,
) -> GradeResult:
    """Score what the test runner reported; a run that never started is an infra fault."""
    tests: dict[str, str] = {}
    details: dict[str, str] = {}
    started = done = False
    fatal = ""
    for msg in messages:
        if msg.get("started"):
            started = True
        elif msg.get("done"):
            done = True
        elif msg.get("fatal"):
            fatal = str(msg["fatal"])
        elif isinstance(msg.get("id"), str) and msg["id"] in ids:
            tests[msg["id"]] = str(msg.get("status"))
            if msg.get("detail"):
                details[msg["id"]] = str(msg["detail"])
    seconds = time.monotonic() - t0
    if not started or fatal:
        why = fatal or f"grading did not start: {stderr[-800:]}"
        return GradeResult(None, False, {}, True, why, seconds)
    for t in ids:
        tests.setdefault(t, "timeout" if timed_out else "error")
    reward, resolved = score(task, tests, partial_credit)
    detail = "timed out" if timed_out else ("" if done else "test process died")
    if not resolved:
        failing = [
            f"{t}: {tests[t]}: {details.get(t, '')[-300:]}" for t in ids if tests[t] != "passed"
        ]
        detail = (detail + "\n" + "\n".join(failing[:5])).strip()
    return GradeResult(reward, resolved, tests, False, detail, seconds)


async def _grade_one_shot(
    runtime: Runtime,
    session: Session,
    hidden: Path,
    spec: dict[str, Any],
    timeout_s: float,
    framework: str,
) -> tuple[list[dict[str, Any]], bool, str, str]:
    """A fresh sandbox (or, unsandboxed, a copied tree) running the test runner once:
    (messages, timed out, stderr tail, error that kept it from starting)."""
    # unittest needs only the standard library: skip site-packages (and its .pth files) then
    flags = ("-I", "-S") if framework == "unittest" else ("-I",)
    cgroup = None
    spec = dict(spec)
    if runtime.sandboxed:
        assert runtime.cgroups is not None
        lim = runtime.config.limits
        mem = lim.memory_bytes + lim.disk_bytes + lim.tmp_bytes
        cgroup = await asyncio.to_thread(runtime.cgroups.create, mem, lim.pids)
        spec["workspace"] = bw.WORKSPACE
        argv = runtime.base_argv + bw.workspace_args(
            [*session.final_layers(), str(hidden)], None, None
        )
        argv += bw.tool_argv(runtime.config.python, "runner", bw.TOOLS_MOUNT, flags)
        argv.append(json.dumps(spec))
    else:
        tree = session.dir / "grade"
        await asyncio.to_thread(shutil.copytree, session.final_layers()[0], tree, symlinks=True)
        await asyncio.to_thread(shutil.copytree, hidden, tree, symlinks=True, dirs_exist_ok=True)
        spec["workspace"] = str(tree)
        argv = bw.tool_argv(runtime.config.python, "runner", str(bw.INSIDE_DIR), flags)
        argv.append(json.dumps(spec))
    try:
        proc = await spawn(argv, cgroup, subprocess.PIPE)
    except OSError as e:
        if cgroup is not None:
            await asyncio.to_thread(cgroup.remove)
        return [], False, "", f"could not start grading: {e}"
    messages: list[dict[str, Any]] = []
    err_tail = bytearray()

    async def drain_stderr() -> None:
        assert proc.stderr is not None
        while chunk := await proc.stderr.read(1 << 16):
            err_tail.extend(chunk)
            del err_tail[:-4000]

    async def read_results() -> None:
        assert proc.stdout is not None
        while line := await proc.stdout.readline():
            with contextlib.suppress(ValueError):
                msg = json.loads(line)
                if isinstance(msg, dict):
                    messages.append(msg)

    drainer = asyncio.create_task(drain_stderr())
    timed_out = False
    try:
        await asyncio.wait_for(read_results(), timeout_s)
    except TimeoutError:
        timed_out = True
    except (ValueError, asyncio.LimitOverrunError):
        pass
    finally:
        await reap(proc, cgroup)
        drainer.cancel()
        if not runtime.sandboxed:
            await asyncio.to_thread(shutil.rmtree, session.dir / "grade", True)
    return messages, timed_out, err_tail.decode("utf-8", "replace"), ""
