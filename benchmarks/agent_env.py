"""Sandbox cost and throughput of tandem-agent-env, measured side by side in one process.

Prints: median latency of one command through the sandboxed `bash` tool versus a bare
subprocess (a builtin, then an external program, also against a bare persistent bash); tool commands per second with 1, 16, 64 and 256 concurrent episodes; and full
episode lifecycles per second (reset, 10 tool calls, then close, or submit + grading with the
hidden tests) on generated tasks, with the fork server (the default) and with a bwrap sandbox
started per episode and per grading. Targets (2-core machine): >= 400 commands/s at 256
episodes, >= 50 lifecycles/s without grading and >= 20 with it, sandbox overhead <= 5 ms.

    uv run python benchmarks/agent_env.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import statistics
import time
from pathlib import Path

import msgspec

from tandem.agent_env import Env, EnvConfig, ToolCall, generate_tasks

BASH = ToolCall("bash", json.dumps({"command": "echo hi"}))


def cpu_s() -> float:
    """CPU seconds of this process (the host side: event loop, tools, bookkeeping)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class TreeCPU:
    """CPU seconds of this process *and every process it starts* (sandboxes, supervisors,
    commands, graders), from a cgroup v1 cpuacct group this benchmark moves itself into. The
    machine is shared, so wall-clock rates depend on the others' load; this does not."""

    def __init__(self) -> None:
        root = Path("/sys/fs/cgroup/cpuacct")
        self.dir = root / f"tandem-bench-{os.getpid()}"
        self.home = root
        try:
            self.dir.mkdir()
            (self.dir / "cgroup.procs").write_text(str(os.getpid()))
        except OSError:
            self.dir = None  # type: ignore[assignment]

    def __call__(self) -> float | None:
        if self.dir is None:
            return None
        return int((self.dir / "cpuacct.usage").read_text()) / 1e9

    def close(self) -> None:
        if self.dir is not None:
            for _ in range(3):  # this process and any helper it started go back home
                for pid in (self.dir / "cgroup.procs").read_text().split():
                    with contextlib.suppress(OSError):  # it may have exited already
                        (self.home / "cgroup.procs").write_text(pid)
            for _ in range(200):
                try:
                    self.dir.rmdir()
                    break
                except OSError:
                    time.sleep(0.01)


async def bare_latency(n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(
            "/bin/bash",
            "-c",
            "echo hi",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        await proc.communicate()
        out.append(time.perf_counter() - t0)
    return out


async def bare_shell_latency(command: str, n: int) -> list[float]:
    """The same command through a persistent bash with no sandbox (pipes, a marker line): the
    baseline that isolates what the sandbox and its supervisor add to a persistent shell."""
    proc = await asyncio.create_subprocess_exec(
        "/bin/bash",
        "--norc",
        "--noprofile",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert proc.stdin is not None and proc.stdout is not None
    out = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            proc.stdin.write(f"{command}; echo __done__ $?\n".encode())
            await proc.stdin.drain()
            while not (await proc.stdout.readline()).startswith(b"__done__"):
                pass
            out.append(time.perf_counter() - t0)
    finally:
        proc.stdin.close()
        await proc.wait()
    return out


async def bare_latency_cmd(command: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(
            "/bin/bash",
            "-c",
            command,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        await proc.communicate()
        out.append(time.perf_counter() - t0)
    return out


async def sandbox_latency(task, config: EnvConfig, n: int) -> list[float]:
    env = Env(task, config)
    await env.reset()
    out = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            await env.step(BASH)
            out.append(time.perf_counter() - t0)
    finally:
        await env.close()
    return out


async def commands_per_s(
    tasks, config: EnvConfig, episodes: int, per_episode: int, tree: TreeCPU
) -> tuple[float, float, str]:
    """Commands/s once all episodes are up; host and all-process CPU ms per command over the
    same phase (resets and closes excluded)."""
    envs = [Env(tasks[i % len(tasks)], config) for i in range(episodes)]
    await asyncio.gather(*(e.reset() for e in envs))
    try:

        async def drive(env: Env) -> None:
            for _ in range(per_episode):
                await env.step(BASH)

        n = episodes * per_episode
        c0, t0, w0 = cpu_s(), tree(), time.perf_counter()
        await asyncio.gather(*(drive(e) for e in envs))
        rate = n / (time.perf_counter() - w0)
        return rate, (cpu_s() - c0) / n * 1e3, _ms(t0, tree(), n)
    finally:
        await asyncio.gather(*(e.close() for e in envs))


CALLS = [
    ToolCall("list_dir", "{}"),
    ToolCall("bash", json.dumps({"command": "ls tests"})),
    ToolCall("search", json.dumps({"pattern": "def ", "glob": "*.py"})),
    ToolCall("bash", json.dumps({"command": "wc -l *.py"})),
    ToolCall("bash", json.dumps({"command": "echo hi"})),
    ToolCall("bash", json.dumps({"command": "cat tests/__init__.py"})),
    ToolCall("write_file", json.dumps({"path": "notes.txt", "content": "looking\n"})),
    ToolCall("bash", json.dumps({"command": "cat notes.txt"})),
    ToolCall("bash", json.dumps({"command": "git --version || true"})),
    ToolCall("bash", json.dumps({"command": "true"})),
]


async def lifecycles_per_s(
    tasks, config: EnvConfig, n: int, concurrency: int, grade: bool
) -> tuple[float, int]:
    sem = asyncio.Semaphore(concurrency)
    rewards = []

    async def one(task) -> None:
        async with sem:
            env = Env(task, config)
            await env.reset()
            try:
                for c in CALLS:
                    await env.step(c)
                if grade:
                    res = await env.step(ToolCall("submit"))
                    rewards.append(res.reward)
            finally:
                await env.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(one(tasks[i % len(tasks)]) for i in range(n)))
    graded = sum(r is not None for r in rewards)
    return n / (time.perf_counter() - t0), graded


async def main(quick: bool) -> None:
    tree = TreeCPU()
    try:
        await _main(quick, tree)
    finally:
        tree.close()


def _ms(a: float | None, b: float | None, n: int) -> str:
    return "n/a" if a is None or b is None else f"{(b - a) / n * 1e3:.2f}"


async def _main(quick: bool, tree: TreeCPU) -> None:
    config = EnvConfig(max_turns=100_000)
    tasks = generate_tasks(2024, 64)
    await sandbox_latency(tasks[0], config, 5)  # start the runtime (probe, cgroups, mounts)
    n_lat = 50 if quick else 200
    t0 = tree()
    bare = await bare_latency(n_lat)
    env = Env(tasks[0], config)
    await env.reset()
    t1 = tree()
    boxed = []
    for _ in range(n_lat):
        w = time.perf_counter()
        await env.step(BASH)
        boxed.append(time.perf_counter() - w)
    t2 = tree()
    await env.close()
    mb, ms = statistics.median(bare) * 1e3, statistics.median(boxed) * 1e3
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} (shared)")
    print()
    print(
        f"{'one command (echo hi)':<44}{'bare subprocess':>16}{'sandboxed tool':>16}{'overhead':>10}"
    )
    print(f"{'median latency (ms)':<44}{mb:>16.2f}{ms:>16.2f}{ms - mb:>10.2f}   target <= 5 ms")
    cb, cs = _ms(t0, t1, n_lat), _ms(t1, t2, n_lat)
    over = "n/a" if "n/a" in (cb, cs) else f"{float(cs) - float(cb):.2f}"
    print(f"{'all-process CPU ms per command':<44}{cb:>16}{cs:>16}{over:>10}")
    # a command that is not a shell builtin (one fork+exec in every variant), and a persistent
    # bash without a sandbox: what isolation itself costs on top of the same shell design
    ext = "/bin/echo hi"
    ext_call = ToolCall("bash", json.dumps({"command": ext}))
    t0 = tree()
    bare_ext = await bare_latency_cmd(ext, n_lat)
    t1 = tree()
    shell_ext = await bare_shell_latency(ext, n_lat)
    t2 = tree()
    env = Env(tasks[0], config)
    await env.reset()
    t3 = tree()
    boxed_ext = []
    for _ in range(n_lat):
        w = time.perf_counter()
        await env.step(ext_call)
        boxed_ext.append(time.perf_counter() - w)
    t4 = tree()
    await env.close()
    m1, m2, m3 = (statistics.median(x) * 1e3 for x in (bare_ext, shell_ext, boxed_ext))
    print()
    print(
        f"{'one command (/bin/echo hi, fork+exec)':<44}{'bare bash -c':>16}{'bare bash loop':>16}"
        f"{'sandboxed tool':>16}{'overhead vs loop':>18}"
    )
    print(f"{'median latency (ms)':<44}{m1:>16.2f}{m2:>16.2f}{m3:>16.2f}{m3 - m2:>18.2f}")
    c1, c2, c3 = _ms(t0, t1, n_lat), _ms(t1, t2, n_lat), _ms(t3, t4, n_lat)
    ov = "n/a" if "n/a" in (c2, c3) else f"{float(c3) - float(c2):.2f}"
    print(f"{'all-process CPU ms per command':<44}{c1:>16}{c2:>16}{c3:>16}{ov:>18}")
    print()
    print(f"{'concurrent episodes':<44}" + "".join(f"{k:>10}" for k in (1, 16, 64, 256)))
    rates, cpu, tcpu = [], [], []
    for k in (1, 16, 64, 256):
        per = max(8, (200 if quick else 1600) // k)
        rate, host, allp = await commands_per_s(tasks, config, k, per, tree)
        rates.append(rate)
        cpu.append(host)
        tcpu.append(allp)
    print(
        f"{'tool commands/s (bash echo)':<44}"
        + "".join(f"{r:>10.0f}" for r in rates)
        + "   target >= 400 at 256"
    )
    print(f"{'host-process CPU ms per command':<44}" + "".join(f"{c:>10.2f}" for c in cpu))
    print(f"{'all-process CPU ms per command':<44}" + "".join(f"{c:>10}" for c in tcpu))
    print()
    n = 64 if quick else 256
    rows = []
    # the default (episodes and gradings forked from one warm sandbox) and, for comparison in
    # the same run, a bwrap sandbox (and interpreter) started per episode and per grading
    bwrap_each = msgspec.structs.replace(
        config, sandbox=msgspec.structs.replace(config.sandbox, fork_server=False)
    )
    for label, cfg in (("fork server", config), ("bwrap per sandbox", bwrap_each)):
        c0, t0 = cpu_s(), tree()
        no_grade, _ = await lifecycles_per_s(tasks, cfg, n, 64, grade=False)
        c1, t1 = cpu_s(), tree()
        with_grade, graded = await lifecycles_per_s(tasks, cfg, n, 64, grade=True)
        c2, t2 = cpu_s(), tree()
        rows.append((label, no_grade, with_grade, c0, c1, c2, t0, t1, t2, graded))
    print(f"{'episode lifecycles/s (64 at a time)':<44}{'no grading':>16}{'with grading':>16}")
    for label, no_grade, with_grade, c0, c1, c2, t0, t1, t2, graded in rows:
        print(f"{label}: {graded} of {n} graded")
        print(
            f"{'  reset + 10 tool calls (+ submit, hidden tests)':<44}"
            f"{no_grade:>16.1f}{with_grade:>16.1f}   targets >= 50 / >= 20"
        )
        print(
            f"{'  host-process CPU ms per lifecycle':<44}"
            f"{(c1 - c0) / n * 1e3:>16.1f}{(c2 - c1) / n * 1e3:>16.1f}"
        )
        print(f"{'  all-process CPU ms per lifecycle':<44}{_ms(t0, t1, n):>16}{_ms(t1, t2, n):>16}")
        if t0 is not None:
            print(
                f"{'  CPU-bound capacity of ' + str(os.cpu_count()) + ' idle cores':<44}"
                f"{os.cpu_count() / (t1 - t0) * n:>16.0f}{os.cpu_count() / (t2 - t1) * n:>16.0f}"
                "   (cores / all-process CPU per lifecycle)"
            )
    print(f"({n} episodes per cell; load average now {os.getloadavg()[0]:.1f})")
    if tree() is not None:
        cmd = float(tcpu[-1])
        print(
            f"CPU-bound capacity of {os.cpu_count()} idle cores: "
            f"{os.cpu_count() / cmd * 1e3:.0f} commands/s at 256 episodes"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    asyncio.run(main(parser.parse_args().quick))
