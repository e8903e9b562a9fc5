"""Sandbox cost and throughput of tandem-agent-env, measured side by side in one process.

Prints: median latency of one command through the sandboxed `bash` tool versus a bare
subprocess; tool commands per second with 1, 16, 64 and 256 concurrent episodes; and full
episode lifecycles per second (reset, 10 tool calls, then close, or submit + grading with the
hidden tests) on generated tasks. Targets (2-core machine): >= 400 commands/s at 256
episodes, >= 50 lifecycles/s without grading and >= 20 with it, sandbox overhead <= 5 ms.

    uv run python benchmarks/agent_env.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import time

from tandem.agent_env import Env, EnvConfig, ToolCall, generate_tasks

BASH = ToolCall("bash", json.dumps({"command": "echo hi"}))


def cpu_s() -> float:
    """CPU seconds of this process (the host side: event loop, tools, bookkeeping)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


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


async def commands_per_s(tasks, config: EnvConfig, episodes: int, per_episode: int) -> float:
    envs = [Env(tasks[i % len(tasks)], config) for i in range(episodes)]
    await asyncio.gather(*(e.reset() for e in envs))
    try:

        async def drive(env: Env) -> None:
            for _ in range(per_episode):
                await env.step(BASH)

        t0 = time.perf_counter()
        await asyncio.gather(*(drive(e) for e in envs))
        return episodes * per_episode / (time.perf_counter() - t0)
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
    config = EnvConfig(max_turns=100_000)
    tasks = generate_tasks(2024, 64)
    await sandbox_latency(tasks[0], config, 5)  # start the runtime (probe, cgroups, mounts)
    n_lat = 50 if quick else 200
    bare = await bare_latency(n_lat)
    boxed = await sandbox_latency(tasks[0], config, n_lat)
    mb, ms = statistics.median(bare) * 1e3, statistics.median(boxed) * 1e3
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print()
    print(
        f"{'one command (echo hi)':<44}{'bare subprocess':>16}{'sandboxed tool':>16}{'overhead':>10}"
    )
    print(f"{'median latency (ms)':<44}{mb:>16.2f}{ms:>16.2f}{ms - mb:>10.2f}   target <= 5 ms")
    print()
    print(f"{'concurrent episodes':<44}" + "".join(f"{k:>10}" for k in (1, 16, 64, 256)))
    rates, cpu = [], []
    for k in (1, 16, 64, 256):
        per = max(4, (200 if quick else 800) // k)
        c0 = cpu_s()
        rates.append(await commands_per_s(tasks, config, k, per))
        cpu.append((cpu_s() - c0) / (k * per) * 1e3)  # includes the resets and closes
    print(
        f"{'tool commands/s (bash echo)':<44}"
        + "".join(f"{r:>10.0f}" for r in rates)
        + "   target >= 400 at 256"
    )
    print(f"{'host-process CPU ms per command':<44}" + "".join(f"{c:>10.2f}" for c in cpu))
    print()
    n = 64 if quick else 256
    c0 = cpu_s()
    no_grade, _ = await lifecycles_per_s(tasks, config, n, 64, grade=False)
    c1 = cpu_s()
    with_grade, graded = await lifecycles_per_s(tasks, config, n, 64, grade=True)
    c2 = cpu_s()
    print(f"{'episode lifecycles/s (64 at a time)':<44}{'no grading':>16}{'with grading':>16}")
    print(
        f"{'reset + 10 tool calls (+ submit, hidden tests)':<44}"
        f"{no_grade:>16.1f}{with_grade:>16.1f}   targets >= 50 / >= 20"
    )
    print(
        f"{'host-process CPU ms per lifecycle':<44}"
        f"{(c1 - c0) / n * 1e3:>16.1f}{(c2 - c1) / n * 1e3:>16.1f}"
    )
    print(f"({n} episodes each; {graded} graded; load average now {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    asyncio.run(main(parser.parse_args().quick))
