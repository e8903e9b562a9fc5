"""Hostile commands through the tools: each yields a clear error or a truncated result,
changes nothing outside the episode, and leaves a concurrently running episode intact.

Limits are tight (see conftest) so every case ends within a few seconds; the autouse leak
check asserts that cgroups, processes and episode directories are gone afterwards.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import uuid
from pathlib import Path

import msgspec
import pytest

from tandem.agent_env import Env, EnvConfig, StepResult, TaskLimits, ToolCall, generate_tasks

TASK = generate_tasks(11, 1)[0]
MARK = "neighbour-" + uuid.uuid4().hex


def bash(command: str) -> ToolCall:
    return ToolCall("bash", json.dumps({"command": command}))


def tool(name: str, **args: object) -> ToolCall:
    return ToolCall(name, json.dumps(args))


async def _hostile(
    calls: list[ToolCall], config: EnvConfig, task=TASK
) -> tuple[list[StepResult], Env]:
    victim, neighbour = Env(task, config), Env(TASK, config)
    await victim.reset()
    await neighbour.reset()
    results: list[StepResult] = []
    try:
        await neighbour.step(tool("write_file", path="marker.txt", content=MARK))
        for call in calls:
            results.append(await victim.step(call))
            check = await neighbour.step(bash("cat marker.txt && echo alive"))
            assert MARK in check.observation.content and "alive" in check.observation.content
            if results[-1].done:
                break
    finally:
        await victim.close()
        await neighbour.close()
    return results, victim


def hostile(calls: list[ToolCall], config: EnvConfig, task=TASK) -> list[str]:
    results, _ = asyncio.run(_hostile(calls, config, task))
    return [r.observation.content for r in results]


def test_fork_bombs_hit_the_pids_cgroup(config: EnvConfig) -> None:
    out = hostile(
        [
            bash("python3 -c 'import os\nwhile True: os.fork()'"),
            bash(":(){ :|:& };:; sleep 1; echo done"),
            bash("echo alive; ls /proc | grep -c '^[0-9]'"),
        ],
        config,
    )
    assert f"process limit reached: fork failed at {config.sandbox.limits.pids} processes" in out[0]
    assert "alive" in out[2]
    # only the sandbox's init, the supervisor, bash and grep are left
    assert int(out[2].split("alive\n")[1].split("\n")[0]) <= 5


def _short_timeout(config: EnvConfig) -> EnvConfig:
    limits = msgspec.structs.replace(config.sandbox.limits, command_timeout_s=2.0)
    return msgspec.structs.replace(
        config, sandbox=msgspec.structs.replace(config.sandbox, limits=limits)
    )


def test_infinite_loops_are_killed_at_the_wall_limit(config: EnvConfig) -> None:
    out = hostile(
        [bash("while :; do :; done"), bash("python3 -c 'while True: pass'")], _short_timeout(config)
    )
    for text in out:
        assert "killed: still running after 2 s (wall-clock limit)" in text


def test_a_gigabyte_of_output_is_truncated_head_and_tail(config: EnvConfig) -> None:
    out = hostile([bash("echo FIRST; head -c 1000000000 /dev/zero | tr '\\0' x")], config)[0]
    assert out.startswith("FIRST\nxxx")
    assert "bytes of output omitted" in out
    assert "killed: produced more than 4 MiB of output" in out
    lim = config.sandbox.limits
    assert len(out) < lim.output_head_chars + lim.output_tail_chars + 300


def test_memory_hog_is_oom_killed_by_the_memory_cgroup(config: EnvConfig) -> None:
    out = hostile(
        [bash("python3 -c 'x = bytearray(4 << 30); print(len(x))'"), bash("echo ok")], config
    )
    assert "out of memory" in out[0] or "MemoryError" in out[0]
    assert "ok" in out[1]


def test_writes_outside_the_workspace_change_nothing_on_the_host(config: EnvConfig) -> None:
    name = "tandem-escape-" + uuid.uuid4().hex
    targets = [Path("/") / name, Path.home() / name, Path("/tmp") / name, Path("/usr") / name]
    cmds = "; ".join(f"echo pwned > {t}" for t in targets) + f"; cat /tmp/{name}; touch ~/{name}"
    out = hostile(
        [
            bash(cmds),
            tool("write_file", path=f"/tmp/{name}", content="x"),
            tool("write_file", path=f"../{name}", content="x"),
            tool("write_file", path=str(Path.home() / name), content="x"),
        ],
        config,
    )
    assert "Read-only file system" in out[0] or "No such file" in out[0]
    for text in out[1:]:
        assert "outside the workspace" in text
    for t in targets:
        assert not t.exists(), t


def test_host_secrets_are_invisible(config: EnvConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_HOST_SECRET", "s3cr3t-" + uuid.uuid4().hex)
    secret = os.environ["TANDEM_HOST_SECRET"]
    out = hostile(
        [
            bash("cat /etc/shadow; ls -a /root; env; cat /proc/*/environ | tr '\\0' '\\n'"),
            tool("read_file", path="/etc/shadow"),
            tool("read_file", path="/root/.bashrc"),
            tool("list_dir", path="/root"),
        ],
        config,
    )
    assert "/etc/shadow: No such file or directory" in out[0]
    assert "/root" in out[0] and "No such file" in out[0]
    assert secret not in out[0]
    for text in out[1:]:
        assert "outside the workspace" in text


def test_no_network_to_host_loopback_or_outside(config: EnvConfig) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    port = server.getsockname()[1]
    accepted: list[object] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                accepted.append(server.accept())
            except OSError:
                continue

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    probe = (
        "python3 -c 'import socket, sys\n"
        "try:\n    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.5)\n"
        '    print("CONNECTED")\nexcept OSError as e:\n    print("FAILED", type(e).__name__, e.errno)\' '
    )
    try:
        out = hostile([bash(probe + f"127.0.0.1 {port}"), bash(probe + "192.0.2.1 80")], config)
    finally:
        stop.set()
        thread.join()
        server.close()
    assert "FAILED ConnectionRefusedError 111" in out[0]
    # ENETUNREACH at once (only the sandbox's own loopback exists), not a timeout
    assert "FAILED OSError 101" in out[1]
    assert accepted == []


def test_file_tools_refuse_symlinks_that_leave_the_workspace(config: EnvConfig) -> None:
    out = hostile(
        [
            bash("ln -s /etc/passwd link && ln -s / up && ln -s /tmp tmpdir && echo made"),
            tool("read_file", path="link"),
            tool("read_file", path="up/etc/passwd"),
            tool("write_file", path="tmpdir/evil", content="x"),
            tool("edit", path="link", old_string="root", new_string="toor"),
            tool("list_dir", path="up"),
            tool("search", pattern="root", path="up/etc"),
        ],
        config,
    )
    assert "made" in out[0]
    for text in out[1:]:
        assert text.startswith("error: refused:") and "outside the workspace" in text


@pytest.mark.parametrize("fork_server", [True, False])
def test_killing_the_parent_leaves_the_episode_usable(config: EnvConfig, fork_server: bool) -> None:
    config = msgspec.structs.replace(
        config, sandbox=msgspec.structs.replace(config.sandbox, fork_server=fork_server)
    )
    out = hostile(
        [
            tool("write_file", path="kept.txt", content="still here"),
            bash("export KEPT=yes; setsid sleep 300 > /dev/null 2>&1 & kill -9 $PPID; sleep 2"),
            bash("cat kept.txt; echo exported=$KEPT; ls /proc | grep -c '^[0-9]'"),
            bash("kill -9 1; echo init-survives"),
        ],
        config,
    )
    # in both modes the supervisor is its sandbox's init (bwrap: --as-pid-1): a signal from
    # inside the sandbox does not reach it, and the shell goes on (the background sleep is
    # swept after the call)
    assert "a new one was started" not in out[1] and "[exit code 0]" in out[1]
    assert "exported=yes" in out[2]
    assert int(out[2].split("exported=yes\n")[1].split("\n")[0]) <= 4
    assert "still here" in out[2]
    assert "init-survives" in out[3]


def test_filling_the_disk_fails_with_enospc(config: EnvConfig) -> None:
    out = hostile(
        [
            bash(
                "for i in $(seq 1 20); do head -c 30000000 /dev/zero > f$i || break; done; echo end"
            ),
            bash("rm -f f*; echo removed"),
            bash("head -c 100000000 /dev/zero > /tmp/big; echo tmp-end"),
            bash("head -c 100000000 /dev/zero > one-big-file; echo file-end"),
            bash("echo x > /dev/evil; df --output=size -B1M /dev/shm | tail -1"),
        ],
        config,
    )
    assert "No space left on device" in out[0] and "end" in out[0]
    assert "removed" in out[1]
    assert "File size limit exceeded" in out[2] or "No space left on device" in out[2]
    assert "File size limit exceeded" in out[3]
    assert "/dev/evil: Read-only file system" in out[4]
    assert (
        int(out[4].splitlines()[1]) == config.sandbox.limits.tmp_bytes >> 20
    )  # /dev/shm is capped


def test_zip_bomb_is_stopped_by_the_file_size_limit(config: EnvConfig) -> None:
    make = (
        "python3 -c 'import zipfile\n"
        'with zipfile.ZipFile("bomb.zip", "w", zipfile.ZIP_DEFLATED) as z:\n'
        '    with z.open("zeros", "w", force_zip64=True) as f:\n'
        "        [f.write(bytes(1 << 20)) for _ in range(80)]' && stat -c %s bomb.zip"
    )
    out = hostile([bash(make), bash("python3 -m zipfile -e bomb.zip out; echo rc=$?")], config)
    assert int(out[0].split("\n")[0]) < 1_000_000
    assert "File size limit exceeded" in out[1] or "File too large" in out[1] or "SIGXFSZ" in out[1]


def test_sleeping_past_the_episode_wall_limit_ends_the_episode(config: EnvConfig) -> None:
    task = msgspec.structs.replace(TASK, limits=TaskLimits(episode_wall_s=1.5))
    results, victim = asyncio.run(_hostile([bash("sleep 60"), bash("echo never")], config, task))
    assert len(results) == 1
    assert "killed: still running" in results[0].observation.content
    assert results[0].done and results[0].info["termination"] == "wall_limit"
    assert results[0].reward == 0.0  # graded like any episode, not an infra fault
    assert victim.trajectory().infra_fault is False


def test_malformed_tool_calls_cost_a_turn_and_explain(config: EnvConfig) -> None:
    calls = [
        ToolCall("rm_rf", "{}"),
        ToolCall("bash", "{not json"),
        ToolCall("bash", "{}"),
        ToolCall("bash", json.dumps({"command": 42})),
        ToolCall("read_file", json.dumps({"path": "x", "start_line": "1"})),
        ToolCall("bash", b'{"command": "echo \xff\xfe"}'),
        ToolCall("bash", '{"command": "echo \\udc80"}'),
        ToolCall("bash", "[1, 2]"),
        ToolCall(
            "edit", json.dumps({"path": "x", "old_string": "a", "new_string": "b", "extra": 1})
        ),
    ]
    out = hostile(calls, config)
    expected = [
        "unknown tool 'rm_rf'",
        "not valid JSON",
        "missing the required argument 'command'",
        "bash.command must be a string, got int",
        "read_file.start_line must be an integer, got str",
        "not valid UTF-8",
        "not valid UTF-8",
        "must be a JSON object, got list",
        "edit has no argument 'extra'",
    ]
    for text, want in zip(out, expected, strict=True):
        assert text.startswith("error:") and want in text, (text, want)
