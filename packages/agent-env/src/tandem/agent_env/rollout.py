"""`run_episodes`: drive many episodes concurrently from one asyncio process."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import structlog

from tandem.agent_env.config import EnvConfig
from tandem.agent_env.env import Env
from tandem.agent_env.errors import SandboxError
from tandem.agent_env.sandbox.runtime import Runtime
from tandem.agent_env.task import Task
from tandem.agent_env.tools import ToolCall
from tandem.agent_env.trajectory import Trajectory

log = structlog.get_logger()

Policy = Callable[[list[dict[str, Any]]], Awaitable[ToolCall | dict[str, Any]]]


def runtime_for(config: EnvConfig) -> Runtime:
    """The shared runtime for ``config``, falling back to unsandboxed only if allowed."""
    try:
        return Runtime.shared(config.sandbox, sandboxed=True)
    except SandboxError as e:
        if not config.allow_unsandboxed:
            raise
        log.warning("agent_env.unsandboxed", reason=str(e))
        return Runtime.shared(config.sandbox, sandboxed=False)


async def run_episode(
    policy: Policy, task: Task, config: EnvConfig, runtime: Runtime
) -> Trajectory:
    """One episode to the end. Failures of the sandbox or of the policy mark the trajectory as
    an infrastructure fault (reward None) instead of raising.

    A policy with a ``for_task(task)`` method (a scripted one, such as `OraclePolicy`, that
    must know its task even when another task has the same instruction) is asked for the
    episode's policy first."""
    bind = getattr(policy, "for_task", None)
    if bind is not None:
        policy = bind(task)
    env = Env(task, config, runtime=runtime)
    try:
        try:
            await env.reset()
        except SandboxError as e:
            return _faulted(env, "infra_fault", f"reset failed: {e}")
        while not env.done:
            try:
                call = await policy(list(env.messages))
            except Exception as e:
                return _faulted(env, "policy_error", f"{type(e).__name__}: {e}")
            await env.step(call)
        return env.trajectory()
    finally:
        await env.close()


def _faulted(env: Env, reason: str, detail: str) -> Trajectory:
    traj = env.trajectory()
    traj.termination = reason
    traj.infra_fault = True
    traj.reward = None
    traj.grade_detail = detail
    return traj


async def run_episodes(
    policy: Policy,
    tasks: Sequence[Task],
    concurrency: int = 64,
    config: EnvConfig | None = None,
    *,
    on_trajectory: Callable[[Trajectory], None] | None = None,
    log_every: int = 0,
) -> list[Trajectory]:
    """Run one episode per task (repeat a task for a group), ``concurrency`` at a time.

    Returns trajectories in task order. ``on_trajectory`` is called as each one finishes
    (e.g. to stream them to a JSONL file or a training buffer).
    """
    if concurrency < 1:
        raise SandboxError(f"concurrency must be >= 1, got {concurrency}")
    config = config or EnvConfig()
    runtime = runtime_for(config)
    sem = asyncio.Semaphore(concurrency)
    results: list[Trajectory | None] = [None] * len(tasks)
    finished = 0
    t0 = time.monotonic()
    every = log_every or max(1, len(tasks) // 10)

    async def one(i: int, task: Task) -> None:
        nonlocal finished
        async with sem:
            traj = await run_episode(policy, task, config, runtime)
        results[i] = traj
        finished += 1
        if on_trajectory is not None:
            on_trajectory(traj)
        if finished % every == 0 or finished == len(tasks):
            log.info(
                "agent_env.progress",
                done=finished,
                total=len(tasks),
                per_s=round(finished / max(time.monotonic() - t0, 1e-9), 2),
            )

    await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks)))
    return [t for t in results if t is not None]
