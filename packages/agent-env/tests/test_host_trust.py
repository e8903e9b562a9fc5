"""Agent code against the host and the supervisor: forged replies, descriptors of the host or
the supervisor, ptrace, the kernel keyring, the system calls the seccomp filter denies, and
tool calls meant to wedge or flood the host. Each case is one short episode (~0.1-0.5 s)."""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import platform

import msgspec
import pytest

from tandem.agent_env import Env, EnvConfig, ToolCall, generate_tasks, run_episodes
from tandem.agent_env.tools import OBSERVATION_SLACK

TASK = generate_tasks(7, 1)[0]


def bash(command: str) -> ToolCall:
    return ToolCall("bash", json.dumps({"command": command}))


def _mode(config: EnvConfig, fork_server: bool) -> EnvConfig:
    return msgspec.structs.replace(
        config, sandbox=msgspec.structs.replace(config.sandbox, fork_server=fork_server)
    )


async def _run(config: EnvConfig, calls: list[ToolCall]) -> list[str]:
    async with Env(TASK, config) as env:
        await env.reset()
        return [(await env.step(c)).observation.content for c in calls]


def observe(config: EnvConfig, calls: list[ToolCall]) -> list[str]:
    return asyncio.run(_run(config, calls))


def python(code: str) -> ToolCall:
    return bash(f"python3 - <<'EOF'\n{code}\nEOF")


@pytest.mark.parametrize("fork_server", [True, False], ids=["forkserver", "bwrap"])
def test_no_descriptor_of_the_host_or_supervisor_is_reachable(
    config: EnvConfig, fork_server: bool
) -> None:
    code = (
        "import os\n"
        "shell = os.getppid()\n"  # the agent's own shell; its parent is the supervisor
        "above = int(open(f'/proc/{shell}/stat').read().rsplit(')', 1)[1].split()[1])\n"
        "for pid in sorted({1, above}):\n"
        "    try:\n"
        "        fds = os.listdir(f'/proc/{pid}/fd')\n"
        "    except OSError as e:\n"
        "        print(pid, 'denied', e.errno)\n"
        "        continue\n"
        "    for fd in fds:\n"
        "        path = f'/proc/{pid}/fd/{fd}'\n"
        "        try:\n"
        "            target = os.readlink(path)\n"
        "        except OSError:\n"
        "            continue\n"
        "        if target == '/dev/null':\n"
        "            continue\n"
        "        try:\n"
        "            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))\n"
        "            print('REACHED', pid, fd, target)\n"
        "        except OSError:\n"
        "            pass\n"
        "print('checked')\n"
    )
    out = observe(_mode(config, fork_server), [python(code), bash("echo still-here")])
    assert "checked" in out[0] and "REACHED" not in out[0], out[0]
    assert "still-here" in out[1]


_SYSCALLS_X86_64 = {
    "ptrace": (101, (16, 1, 0, 0)),  # PTRACE_ATTACH to pid 1
    "process_vm_readv": (310, (1, 0, 0, 0, 0, 0)),
    "process_vm_writev": (311, (1, 0, 0, 0, 0, 0)),
    "pidfd_getfd": (438, (0, 1, 0)),
    "keyctl": (250, (0, -3 & 0xFFFFFFFF, 0)),  # KEYCTL_GET_KEYRING_ID of the session keyring
    "add_key": (248, (0, 0, 0, 0, 0)),
    "request_key": (249, (0, 0, 0, 0)),
    "io_uring_setup": (425, (1, 0)),
    "io_uring_enter": (426, (0, 0, 0, 0, 0, 0)),
    "io_uring_register": (427, (0, 0, 0, 0)),
    "bpf": (321, (0, 0, 0)),
    "perf_event_open": (298, (0, 0, -1 & 0xFFFFFFFF, -1 & 0xFFFFFFFF, 0)),
    "userfaultfd": (323, (0,)),
    "kexec_load": (246, (0, 0, 0, 0)),
    "kexec_file_load": (320, (0, 0, 0, 0, 0)),
    "open_tree": (428, (0, 0, 0)),
    "fsopen": (430, (0, 0)),
    "mount_setattr": (442, (0, 0, 0, 0, 0)),
}


@pytest.mark.skipif(platform.machine() != "x86_64", reason="syscall numbers listed for x86_64")
@pytest.mark.parametrize("fork_server", [True, False], ids=["forkserver", "bwrap"])
def test_the_seccomp_filter_denies_dangerous_calls(config: EnvConfig, fork_server: bool) -> None:
    code = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        f"calls = {_SYSCALLS_X86_64!r}\n"
        "for name, (nr, args) in calls.items():\n"
        "    rc = libc.syscall(nr, *[ctypes.c_long(a) for a in args])\n"
        "    print(name, rc, ctypes.get_errno())\n"
    )
    out = observe(_mode(config, fork_server), [python(code)])[0]
    lines = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line[:1].isalpha()}
    for name in _SYSCALLS_X86_64:
        assert lines.get(name) == ["-1", "1"], (name, lines.get(name), out)  # EPERM


def test_the_supervisor_cannot_be_ptraced_or_its_socket_taken(config: EnvConfig) -> None:
    code = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "rc = libc.ptrace(16, 1, 0, 0)\n"  # the supervisor is its sandbox's pid 1
        "print('ptrace', rc, ctypes.get_errno())\n"
        "fd = libc.syscall(438, os.pidfd_open(1), 1, 0)\n"
        "print('getfd', fd, ctypes.get_errno())\n"
        "if fd >= 0:\n"
        '    os.write(fd, b\'{"ok": true, "exit_code": "x", "output": 5}\\n\')\n'
    )
    out = observe(config, [python(code), bash("echo after")])
    assert "ptrace -1" in out[0] and "getfd -1" in out[0], out[0]
    assert "after" in out[1]


_KEYCTL_JOIN, _SESSION = 1, -3


def test_the_sandbox_has_its_own_empty_session_keyring(config: EnvConfig) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    # this test process gets a session keyring of its own first, then stores a key in it
    if libc.syscall(250, _KEYCTL_JOIN, None) < 0:
        pytest.skip(f"keyrings unavailable here: errno {ctypes.get_errno()}")
    key = libc.syscall(248, b"user", b"tandem-canary", b"host-secret", 11, _SESSION)
    assert key > 0, ctypes.get_errno()
    code = (
        "import ctypes\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "k = libc.syscall(249, b'user', b'tandem-canary', None, 0)\n"
        "print('request_key', k, ctypes.get_errno())\n"
        "buf = ctypes.create_string_buffer(64)\n"
        f"n = libc.syscall(250, 11, {key}, buf, 64)\n"  # KEYCTL_READ by id
        "print('read', n, buf.raw[:max(n, 0)])\n"
    )
    out = observe(config, [bash("cat /proc/keys; echo end"), python(code)])
    assert "tandem-canary" not in out[0], out[0]
    assert "host-secret" not in out[1] and "request_key -1" in out[1], out[1]


def test_a_fifo_is_refused_within_the_command_timeout(config: EnvConfig) -> None:
    cfg = msgspec.structs.replace(
        config,
        sandbox=msgspec.structs.replace(
            config.sandbox,
            limits=msgspec.structs.replace(config.sandbox.limits, command_timeout_s=3.0),
        ),
    )

    async def go() -> list[str]:
        async with Env(TASK, cfg) as env:
            await env.reset()
            await env.step(bash("mkfifo pipe && ln -s pipe link"))
            out = []
            for name, args in (
                ("read_file", {"path": "pipe"}),
                ("edit", {"path": "link", "old_string": "a", "new_string": "b"}),
                ("write_file", {"path": "pipe", "content": "x"}),
            ):
                res = await asyncio.wait_for(env.step(ToolCall(name, json.dumps(args))), 8)
                out.append(res.observation.content)
            out.append((await env.step(bash("echo alive"))).observation.content)
            return out

    out = asyncio.run(go())
    for text in out[:3]:
        assert text.startswith("error:") and "not a regular file" in text, text
    assert "alive" in out[3]


_BIG = "x\n" * 1_000_000  # 2 MB
_LONG = "x\n" * 50_000  # a 100 kB edit: its snippet alone would be 50,000 numbered lines


@pytest.mark.parametrize(
    "call",
    [
        ToolCall("edit", json.dumps({"path": "notes.txt", "old_string": "a", "new_string": _LONG})),
        ToolCall("edit", json.dumps({"path": "notes.txt", "old_string": _BIG, "new_string": "b"})),
        ToolCall("read_file", json.dumps({"path": "d/" + "x" * 2_000_000})),
        ToolCall("list_dir", json.dumps({"path": "y" * 2_000_000})),
        ToolCall("bash", '{"command": ' + "[" * 100_000 + "]" * 100_000 + "}"),
        ToolCall("read_file", '{"path": "notes.txt", "start_line": 1' + "0" * 5000 + "}"),
        ToolCall("read_file", json.dumps({"path": "notes.txt", "start_line": 10**30})),
        ToolCall("list_dir", json.dumps({"depth": -(10**20)})),
        ToolCall("read_file", json.dumps({"path": "notes.txt", "end_line": 1.5})),
        ToolCall("write_file", json.dumps({"path": "a\0b", "content": "x"})),
        ToolCall("search", json.dumps({"pattern": "a", "glob": {"x": [1]}})),
    ],
    ids=[
        "edit-snippet-2MB",
        "edit-old-2MB",
        "path-2MB",
        "list-path-2MB",
        "deep-nesting",
        "5000-digit-int",
        "int-too-large",
        "negative-huge",
        "float-for-int",
        "nul-in-path",
        "object-for-string",
    ],
)
def test_any_malformed_call_is_a_short_error_observation(config: EnvConfig, call: ToolCall) -> None:
    setup = ToolCall("write_file", json.dumps({"path": "notes.txt", "content": "a\n"}))
    out = observe(config, [setup, call, bash("echo alive")])
    cap = config.sandbox.limits.output_head_chars + config.sandbox.limits.output_tail_chars
    assert len(out[1]) <= cap + OBSERVATION_SLACK, len(out[1])
    assert "alive" in out[2]


def test_a_malformed_reply_from_the_supervisor_is_an_error_not_an_exception(
    config: EnvConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tandem.agent_env.sandbox.session import Session

    real = Session.request
    replies = iter(
        [
            {"ok": True, "exit_code": "x", "output": 5},
            {"ok": True},
            {"ok": False, "error": "e" * 1_000_000},
            ["not", "a", "dict"],
        ]
    )

    async def forged(self: Session, req: dict, timeout: float):  # type: ignore[no-untyped-def]
        reply = next(replies, None)
        if reply is None:
            return await real(self, req, timeout)
        await real(self, req, timeout)
        return reply

    monkeypatch.setattr(Session, "request", forged)
    calls = [bash("echo 1"), bash("echo 2"), ToolCall("list_dir"), bash("echo 4"), bash("echo ok")]
    out = observe(config, calls)
    assert all(o.startswith("error:") for o in out[:4]), out
    assert all(len(o) < 12_000 for o in out)
    assert "ok" in out[4]


def test_one_episode_failing_loses_no_other_trajectory(
    config: EnvConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tandem.agent_env.sandbox.session import Session

    real = Session.request

    async def flaky(self: Session, req: dict, timeout: float):  # type: ignore[no-untyped-def]
        if "boom" in str(req.get("cmd", "")):
            raise KeyError("forged")
        return await real(self, req, timeout)

    monkeypatch.setattr(Session, "request", flaky)
    tasks = generate_tasks(7, 3)

    class Policy:
        def for_task(self, task):  # type: ignore[no-untyped-def]
            async def play(messages):  # type: ignore[no-untyped-def]
                if len(messages) == 2:
                    return bash("echo boom" if task is tasks[1] else "echo fine")
                return ToolCall("submit")

            return play

    trajs = asyncio.run(run_episodes(Policy(), tasks, concurrency=3, config=config))
    assert len(trajs) == 3 and all(t.termination == "submitted" for t in trajs), [
        (t.task_id, t.termination) for t in trajs
    ]
    assert os.path.exists("/proc/self")  # (the host process is fine)
