"""Environment pools as Ray actors: sandboxes on their own machines, away from the engines.

A coding agent's tool calls (builds, test runs) want many CPU cores and no accelerator; an
inference engine wants the opposite. With ``RayConfig.env_pools`` the sandboxes of every
episode run in `EnvPool` actors (declaring ``env_cpus``), and a rollout actor drives each
episode through a `RemoteEnv`, which has the interface of `tandem.agent_env.Env` that
`run_episode` uses. The tool calls are the same; only where they run changes (a pool is
picked per episode, the one this rollout actor has the fewest episodes open on).

A pool that dies mid-episode fails that episode as a sandbox fault: its group is dropped
and counted, like any lost sandbox.
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Any

import structlog

from tandem.agent_env import Env, EnvConfig, SandboxError, Task
from tandem.agent_env import ToolCall as EnvToolCall
from tandem.agent_env.trajectory import StepRecord, StepResult, Trajectory

log = structlog.get_logger()

RAY_NAMESPACE = "tandem"


def env_pool_name(run_name: str, stream: int, index: int) -> str:
    """The actor name of a run's ``index``-th environment pool."""
    return f"{run_name}-{stream}-envs-{index}"


class EnvPool:
    """The body of an environment-pool actor: the open episodes of any rollout actors."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.envs: dict[str, Env] = {}
        self.served = 0

    async def reset(self, key: str, task: Task, config: EnvConfig) -> list[dict[str, Any]]:
        """Start episode ``key`` in a fresh sandbox; returns its opening messages."""
        if key in self.envs:
            raise ValueError(f"episode {key} is already open in {self.name}")
        env = Env(task, config)
        self.envs[key] = env
        try:
            await env.reset()
        except BaseException:
            self.envs.pop(key, None)
            await env.close()
            raise
        self.served += 1
        return list(env.messages)

    async def step(
        self, key: str, call: EnvToolCall
    ) -> tuple[StepResult, list[dict[str, Any]], StepRecord]:
        """One tool call: its result, the messages it added, and its step record."""
        env = self._env(key)
        before = len(env.messages)
        result = await env.step(call)
        return result, env.messages[before:], env.steps[-1]

    async def close(self, key: str) -> None:
        env = self.envs.pop(key, None)
        if env is not None:
            await env.close()

    def stats(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "pid": os.getpid(),
            "open": len(self.envs),
            "served": self.served,
        }

    async def stop(self) -> None:
        for key in list(self.envs):
            await self.close(key)

    def _env(self, key: str) -> Env:
        env = self.envs.get(key)
        if env is None:
            raise SandboxError(f"episode {key} is not open in {self.name} (closed or never reset)")
        return env


class EnvPools:
    """A rollout actor's handles on the run's pools; hands out `RemoteEnv` s."""

    def __init__(self, handles: list[Any], owner: str) -> None:
        if not handles:
            raise ValueError("EnvPools needs at least one environment-pool actor")
        self.handles = handles
        self.open = [0] * len(handles)
        self._keys = (f"{owner}-{os.getpid()}-{i}" for i in itertools.count())

    @classmethod
    def lookup(cls, names: list[str], owner: str) -> EnvPools:
        import ray

        return cls([ray.get_actor(n, namespace=RAY_NAMESPACE) for n in names], owner)

    def __call__(self, task: Task, config: EnvConfig) -> RemoteEnv:
        pick = min(range(len(self.handles)), key=lambda i: self.open[i])
        return RemoteEnv(self, pick, next(self._keys), task, config)


class RemoteEnv:
    """`Env`'s episode interface (reset, step, messages, trajectory, close) over an
    `EnvPool` actor. Messages and step records are mirrored here as each call returns, so
    the trajectory is built locally, with any edit the caller made to ``messages``."""

    def __init__(self, pools: EnvPools, pick: int, key: str, task: Task, config: EnvConfig):
        self.pools, self.pick, self.key = pools, pick, key
        self.handle = pools.handles[pick]
        self.task, self.config = task, config
        self.messages: list[dict[str, Any]] = []
        self.steps: list[StepRecord] = []
        self.turn = 0
        self.last: StepResult | None = None
        self._opened = False
        self._t0 = 0.0

    @staticmethod
    def tool_schemas() -> list[dict[str, Any]]:
        return Env.tool_schemas()

    async def _call(self, method: str, *args: Any) -> Any:
        from ray.exceptions import RayActorError

        try:
            return await getattr(self.handle, method).remote(*args)
        except RayActorError as e:
            raise SandboxError(
                f"the environment pool running episode {self.key} was lost: {e}"
            ) from None

    async def reset(self) -> None:
        self._t0 = time.monotonic()
        self.pools.open[self.pick] += 1
        self._opened = True
        self.messages = await self._call("reset", self.key, self.task, self.config)

    async def step(self, call: EnvToolCall) -> StepResult:
        result, added, record = await self._call("step", self.key, call)
        self.messages += added
        self.steps.append(record)
        self.turn += 1
        self.last = result
        return result

    def trajectory(self) -> Trajectory:
        done = self.last is not None and self.last.done
        info = self.last.info if done and self.last is not None else {}
        reward = self.last.reward if done and self.last is not None else None
        return Trajectory(
            task_id=self.task.id,
            messages=list(self.messages),
            steps=list(self.steps),
            termination=str(info.get("termination", "running")),
            reward=reward,
            resolved=bool(info.get("resolved", False)),
            infra_fault=bool(info.get("infra_fault", False)),
            test_results=dict(info.get("tests", {})),
            turns=self.turn,
            wall_s=time.monotonic() - self._t0 if self._t0 else 0.0,
            grade_detail=str(info.get("grade_detail", "")),
            metadata=dict(self.task.metadata),
        )

    async def close(self) -> None:
        if not self._opened:
            return
        self._opened = False
        self.pools.open[self.pick] -= 1
        try:
            await self._call("close", self.key)
        except SandboxError as e:  # the pool is gone, and the sandbox with it
            log.warning("ray.env_pool_lost", episode=self.key, error=str(e)[:200])
