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

Policy = Callable[[list[dict[str, Any]]], Awaitable[ToolCall | dict[str, Any] | str | Any]]
"""An async callable: the conversation so far (OpenAI-style messages) -> the next turn.

It may return a `ToolCall`, an OpenAI tool call or assistant message (a dict, or an SDK
object such as ``response.choices[0].message``), a list of tool calls (several in one turn),
or a str (a text answer); see `tandem.agent_env.replies`. `OpenAIPolicy` is one for any
OpenAI-compatible endpoint."""


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
    """One episode to the end. Failures of the sandbox or of the policy (it raised) mark the
    trajectory as an infrastructure fault (reward None) instead of raising. A policy that
    returns something that is not a turn is a bug in it: ``TypeError`` is raised.

    A policy with a ``for_task(task)`` method (a scripted one, such as `OraclePolicy`, that
    must know its task even when another task has the same instruction) is asked for the
    episode's policy first."""
    return await _play(policy, task, config, runtime, None)


async def _play(
    policy: Policy, task: Task, config: EnvConfig, runtime: Runtime, stop: asyncio.Event | None
) -> Trajectory:
    """`run_episode`; when ``stop`` is set, the episode ends at its next turn, unscored."""
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
            if stop is not None and stop.is_set():
                return _faulted(env, "stopped", "run_episodes stopped: another episode raised")
            try:
                call = await policy(list(env.messages))
            except Exception as e:
                return _faulted(env, "policy_error", f"{type(e).__name__}: {e}")
            await env.step(call)
        return env.trajectory()
    except BaseException:
        if stop is not None:
            stop.set()  # now, not after this close: the others stop at their next turn
        raise
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
    (e.g. to stream them to a JSONL file or a training buffer). If an episode raises (a
    policy that returned something that is not a turn), no further episode starts, those
    running end at their next turn (their sandboxes closed), and the error is raised.
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

    stop = asyncio.Event()
    errors: list[BaseException] = []

    async def one(i: int, task: Task) -> None:
        nonlocal finished
        async with sem:
            if stop.is_set():
                return
            try:
                traj = await _play(policy, task, config, runtime, stop)
            except Exception as e:  # a bug of the policy's (or ours): stop, not cancel
                errors.append(e)
                return
        if traj.termination == "stopped":
            return
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

    # Episodes are stopped between turns rather than cancelled: a cancelled sandbox start
    # or close could leave its cgroup and files behind.
    await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks)))
    if errors:
        raise errors[0]
    return [t for t in results if t is not None]
