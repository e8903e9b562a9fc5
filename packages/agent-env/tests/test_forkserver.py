"""The warm server: jobs are isolated from each other and from the host, verdicts match the
one-shot grading sandbox, and faults of the server are never scored as test failures."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import textwrap
from pathlib import Path

import msgspec
import pytest

from tandem.agent_env import Env, EnvConfig, HiddenTests, Task, ToolCall
from tandem.agent_env.sandbox import forkserver_client as fs
from tandem.agent_env.sandbox.runtime import Runtime


def call(name: str, **args: object) -> ToolCall:
    return ToolCall(name, json.dumps(args))


# The hidden test checks, inside the grading job, what a previous job may have left behind,
# then leaves traces of its own: files in every writable place and a background process that
# would write into the workspace a moment later.
PROBE = textwrap.dedent(
    """
    import ctypes, os, subprocess, sys, time, unittest

    PLACES = ["/tmp/trace", "/dev/shm/trace", "/workspace/trace"]


    class Probe(unittest.TestCase):
        def test_clean_slate(self):
            left = [p for p in PLACES if os.path.exists(p)]
            self.assertEqual(left, [])
            pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
            self.assertEqual(pids, [1])  # alone in its pid namespace
            for p in PLACES:
                with open(p, "w") as f:
                    f.write("left behind")
            subprocess.Popen(
                ["/bin/sh", "-c", "sleep 0.3; echo late > /workspace/trace; sleep 60"],
                start_new_session=True,
            )

        def test_no_privileges(self):
            status = open("/proc/self/status").read()
            for key in ("CapEff:", "CapPrm:", "CapBnd:", "CapAmb:"):
                self.assertEqual(int(status.split(key)[1].split()[0], 16), 0, key)
            # the host's layers are detached: at most the empty mount point is left
            self.assertEqual(os.listdir("/.layers") if os.path.exists("/.layers") else [], [])
            libc = ctypes.CDLL(None, use_errno=True)
            self.assertNotEqual(libc.unshare(0x10000000), 0)  # CLONE_NEWUSER
            self.assertNotEqual(libc.unshare(0x00020000), 0)  # CLONE_NEWNS

        def test_no_host_network(self):
            import socket
            with self.assertRaises(OSError):
                socket.create_connection(("127.0.0.1", PORT), timeout=2)
    """
)


def probe_task(port: int) -> Task:
    return Task(
        id="probe",
        instruction="nothing to do",
        files={"README": "probe\n"},
        hidden_tests=HiddenTests(
            fail_to_pass=(
                "test_probe.Probe.test_clean_slate",
                "test_probe.Probe.test_no_privileges",
                "test_probe.Probe.test_no_host_network",
            ),
            files={"test_probe.py": PROBE.replace("PORT", str(port))},
        ),
    )


async def submit(task: Task, config: EnvConfig, calls: list[ToolCall] = ()) -> object:
    env = Env(task, config)
    await env.reset()
    try:
        for c in calls:
            await env.step(c)
        res = await env.step(ToolCall("submit"))
        return res
    finally:
        await env.close()


@pytest.fixture
def host_server():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    yield srv.getsockname()[1]
    srv.close()


def test_jobs_are_isolated_from_each_other_and_from_the_host(
    config: EnvConfig, host_server: int
) -> None:
    task = probe_task(host_server)

    async def main() -> list:
        first = await submit(task, config)
        server = Runtime.shared(config.sandbox).forkserver
        assert server is not None and server.proc is not None
        pid = server.proc.pid
        await asyncio.sleep(0.6)  # the first job's background process would have written
        rest = await asyncio.gather(*(submit(task, config) for _ in range(4)))
        assert server.proc is not None and server.proc.pid == pid  # the same fork server
        return [first, *rest]

    results = asyncio.run(main())
    for r in results:
        assert r.info["tests"] == {t: "passed" for t in task.hidden_tests.fail_to_pass}, r.info.get(
            "grade_detail"
        )
        assert r.reward == 1.0


SUM_TASK = Task(
    id="sum",
    instruction="total() should add up the numbers; helpers.py is obsolete, delete it.",
    files={
        "stats.py": "def total(xs):\n    return sum(xs) - 1\n",
        "helpers.py": "X = 1\n",
        "pkg/__init__.py": "",
        "pkg/old.py": "VALUE = 'old'\n",
        "tests/__init__.py": "",
        "tests/test_stats.py": (
            "import unittest\nfrom stats import total\n\n\nclass T(unittest.TestCase):\n"
            "    def test_empty(self):\n        self.assertEqual(total([]) + 1, 0 + 1)\n"
        ),
    },
    hidden_tests=HiddenTests(
        fail_to_pass=(
            "tests.test_hidden.H.test_total",
            "tests.test_hidden.H.test_helpers_deleted",
            "tests.test_hidden.H.test_pkg_replaced",
        ),
        pass_to_pass=("tests.test_stats.T.test_empty",),
        files={
            "tests/test_hidden.py": (
                "import os, unittest\nfrom stats import total\n\n\nclass H(unittest.TestCase):\n"
                "    def test_total(self):\n        self.assertEqual(total([1, 2]), 3)\n\n"
                "    def test_helpers_deleted(self):\n"
                "        self.assertFalse(os.path.exists('helpers.py'))\n\n"
                "    def test_pkg_replaced(self):\n"
                "        self.assertEqual(sorted(os.listdir('pkg')), ['__init__.py', 'new.py'])\n"
            )
        },
        reset_paths=("tests/test_stats.py",),
    ),
)

FIX = [
    call("edit", path="stats.py", old_string="sum(xs) - 1", new_string="sum(xs)"),
    call("bash", command="rm helpers.py && rm -r pkg && mkdir pkg && touch pkg/__init__.py"),
    call("write_file", path="pkg/new.py", content="VALUE = 'new'\n"),
    # tampering with a visible test does not count: it is reset before grading
    call("write_file", path="tests/test_stats.py", content="raise SystemExit(1)\n"),
]
PARTIAL = [call("bash", command="rm helpers.py")]


@pytest.mark.parametrize("calls", [FIX, PARTIAL, []], ids=["fixed", "partial", "untouched"])
def test_forked_verdicts_match_the_one_shot_sandbox(config: EnvConfig, calls: list) -> None:
    one_shot = msgspec.structs.replace(
        config, sandbox=msgspec.structs.replace(config.sandbox, fork_server=False)
    )

    async def main() -> tuple:
        warm = await submit(SUM_TASK, config, calls)
        server = Runtime.shared(config.sandbox).forkserver
        assert server is not None and server.alive()
        assert Runtime.shared(one_shot.sandbox).forkserver is None
        return warm, await submit(SUM_TASK, one_shot, calls)

    warm, cold = asyncio.run(main())
    assert warm.info["tests"] == cold.info["tests"]
    assert warm.reward == cold.reward and warm.info["infra_fault"] is cold.info["infra_fault"]
    expected = {"fixed": 1.0, "partial": 0.0, "untouched": 0.0}
    key = "fixed" if calls is FIX else "partial" if calls is PARTIAL else "untouched"
    assert warm.reward == expected[key]
    if calls is PARTIAL:  # deletion seen, the rest not fixed
        assert warm.info["tests"]["tests.test_hidden.H.test_helpers_deleted"] == "passed"
        assert warm.info["tests"]["tests.test_hidden.H.test_total"] == "failed"


def test_a_memory_bomb_fails_its_own_job_only(config: EnvConfig) -> None:
    bomb = call("write_file", path="stats.py", content="X = bytearray(2 << 30)\n")

    async def main() -> tuple:
        return await asyncio.gather(submit(SUM_TASK, config, [bomb]), submit(SUM_TASK, config, FIX))

    bombed, fixed = asyncio.run(main())
    assert bombed.reward == 0.0 and bombed.info["infra_fault"] is False
    assert fixed.reward == 1.0, fixed.info


def test_a_server_killed_between_jobs_is_restarted(config: EnvConfig) -> None:
    async def main() -> tuple:
        first = await submit(SUM_TASK, config, FIX)
        server = Runtime.shared(config.sandbox).forkserver
        assert server is not None and server.proc is not None
        starts = server.starts
        os.kill(server.proc.pid, signal.SIGKILL)
        await asyncio.sleep(0.2)
        second = await submit(SUM_TASK, config, FIX)
        return first, second, server.starts - starts

    first, second, restarts = asyncio.run(main())
    assert first.reward == second.reward == 1.0
    assert restarts == 1


def test_a_forked_episode_has_its_own_loopback_up(config: EnvConfig) -> None:
    """Each job brings up the loopback interface of its fresh network namespace: a server
    inside the episode is reachable on 127.0.0.1 (the host's loopback is not: see
    test_sandbox_escapes)."""
    echo = call(
        "bash",
        command=(
            'python3 -c \'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); '
            "s.listen(); c = socket.create_connection(s.getsockname(), timeout=5); "
            'a, _ = s.accept(); c.sendall(b"lo up"); print(a.recv(5).decode())\''
        ),
    )

    async def main() -> tuple:
        env = Env(SUM_TASK, config)
        await env.reset()
        try:
            assert env._session is not None and env._session.forked
            return (await env.step(echo)).observation
        finally:
            await env.close()

    obs = asyncio.run(main())
    assert "lo up" in obs.content and not obs.is_error, obs.content


def test_a_malformed_job_fails_in_its_own_fork_and_the_server_keeps_serving(
    config: EnvConfig,
) -> None:
    """The server decodes nothing itself (the job's fork does): a message without a socket
    is skipped, and one that is not a job is reported by its fork, not by a dead server."""

    async def main() -> tuple:
        await submit(SUM_TASK, config, FIX)  # the server is up
        server = Runtime.shared(config.sandbox).forkserver
        assert server is not None and server.ctl is not None
        pid = server.proc.pid if server.proc else None
        server.ctl.send(b'{"kind": "session"}')  # no socket attached: ignored
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        mine.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        mine.setblocking(False)
        with mine:
            await fs._send_job(server.ctl, b"not a job", theirs.fileno())
            theirs.close()
            job_pid, first = await fs._recv_creds(mine)
            assert first == b"r" and job_pid > 0
            loop = asyncio.get_running_loop()
            await loop.sock_sendall(mine, b"g")
            report = await fs._read_all(mine, 10.0)
        after = await submit(SUM_TASK, config, FIX)
        return report, after, pid, server.proc.pid if server.proc else None

    report, after, pid, pid_after = asyncio.run(main())
    assert b"job failed to start" in report and b"JSONDecodeError" in report
    assert after.reward == 1.0 and pid_after == pid  # the same server, still serving


def test_a_server_that_cannot_start_falls_back_to_sandboxes_of_their_own(config: EnvConfig) -> None:
    async def main() -> object:
        server = Runtime.shared(config.sandbox).forkserver
        assert server is not None
        server.abandon()
        server.failures = 10**6  # past the restart budget: the fork server is not used
        try:
            env = Env(SUM_TASK, config)
            await env.reset()
            try:
                assert env._session is not None and not env._session.forked  # bwrap's own
                for c in FIX:
                    await env.step(c)
                res = await env.step(ToolCall("submit"))
            finally:
                await env.close()
            assert server.proc is None  # graded by a one-shot sandbox
            return res
        finally:
            server.failures = 0

    res = asyncio.run(main())
    assert res.reward == 1.0 and res.info["infra_fault"] is False


def test_episodes_are_forked_sandboxes_isolated_from_each_other(config: EnvConfig) -> None:
    probe = call(
        "bash",
        command=(
            "id -u; grep -E '^Cap(Eff|Bnd)' /proc/self/status; ls /proc | grep -c '^[0-9]'; "
            "echo layers=$(ls -A /.layers 2>/dev/null | wc -l); unshare -U true 2>&1 | tail -1; "
            "echo $RANDOM > /tmp/mine; ls /tmp; "
            "python3 -c 'import os, pty, time; m, s = pty.openpty(); print(os.ttyname(s)); "
            "time.sleep(0.3)'"
        ),
    )

    async def one(i: int) -> str:
        env = Env(SUM_TASK, config)
        await env.reset()
        try:
            assert env._session is not None and env._session.forked
            await env.step(call("write_file", path=f"only-{i}.txt", content="x"))
            out = (await env.step(probe)).observation.content
            listing = (await env.step(call("list_dir"))).observation.content
            return out + "\n" + listing
        finally:
            await env.close()

    async def main() -> list[str]:
        return await asyncio.gather(*(one(i) for i in range(6)))

    for i, out in enumerate(asyncio.run(main())):
        lines = out.splitlines()
        assert lines[0] == "1000", out
        assert lines[1].split() == ["CapEff:", "0000000000000000"], out
        assert lines[2].split() == ["CapBnd:", "0000000000000000"], out
        assert int(lines[3]) <= 5, out  # init, supervisor, bash, ls, grep: nothing else
        assert lines[4] == "layers=0", out  # the host's layers are detached
        assert "Operation not permitted" in lines[5] or "No space left" in lines[5], out
        assert lines[6] == "mine", out  # a /tmp of its own
        assert lines[7] == "/dev/pts/0", out  # ptys of its own, even while others hold one
        assert f"only-{i}.txt" in out and not any(
            f"only-{j}.txt" in out for j in range(6) if j != i
        )


def test_episodes_survive_a_fork_server_that_dies(config: EnvConfig) -> None:
    async def main() -> list[str]:
        env = Env(SUM_TASK, config)
        await env.reset()
        try:
            out = [
                (await env.step(call("write_file", path="kept.txt", content="kept"))).observation
            ]
            server = Runtime.shared(config.sandbox).forkserver
            assert server is not None and server.proc is not None
            os.kill(server.proc.pid, signal.SIGKILL)  # takes every sandbox it forked with it
            await asyncio.sleep(0.2)
            for c in (call("bash", command="echo hi"), call("bash", command="cat kept.txt")):
                out.append((await env.step(c)).observation)
            assert env._session is not None and env._session.forked  # from a new server
            res = await env.step(ToolCall("submit"))
            out.append(res)
            return out
        finally:
            await env.close()

    wrote, lost, kept, res = asyncio.run(main())
    assert "wrote" in wrote.content
    assert lost.is_error and "a new one was started" in lost.content
    assert "kept" in kept.content and not kept.is_error
    assert res.reward == 0.0 and res.info["infra_fault"] is False  # graded, not lost


def _server_interpreter(config: EnvConfig) -> int:
    """The pid of the fork server's interpreter (below the cgroup shim, nsenter and bwrap)."""
    server = Runtime.shared(config.sandbox).forkserver
    assert server is not None and server.proc is not None
    pid = server.proc.pid
    while Path(f"/proc/{pid}/comm").read_text().strip() != "python3":
        pid = int(Path(f"/proc/{pid}/task/{pid}/children").read_text().split()[0])
    return pid


def test_forked_episodes_have_namespaces_of_their_own(config: EnvConfig) -> None:
    kinds = ("mnt", "net", "ipc", "uts", "pid")
    probe = call(
        "bash", command="for n in " + " ".join(kinds) + "; do readlink /proc/self/ns/$n; done"
    )

    async def one() -> tuple[list[str], list[str]]:
        env = Env(SUM_TASK, config)
        await env.reset()
        try:
            assert env._session is not None and env._session.forked
            out = (await env.step(probe)).observation.content.splitlines()[: len(kinds)]
            server = _server_interpreter(config)
            return out, [os.readlink(f"/proc/{server}/ns/{k}") for k in kinds]
        finally:
            await env.close()

    async def main() -> list[tuple[list[str], list[str]]]:
        return await asyncio.gather(one(), one())

    (first, server), (second, _) = asyncio.run(main())
    host = [os.readlink(f"/proc/self/ns/{k}") for k in kinds]
    for k, a, b, s, h in zip(kinds, first, second, server, host, strict=True):
        assert a.startswith(f"{k}:[") and len({a, b, s, h}) == 4, (k, a, b, s, h)
