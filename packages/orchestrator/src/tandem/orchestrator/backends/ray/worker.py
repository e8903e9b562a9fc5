"""A rollout actor: one engine that plays groups and follows the weight store by itself.

`RolloutWorker` builds the model's shape from its `WorkerSpec`, reaches the newest version
with one catch-up pull (anchor plus at most one delta), then follows the store: notified by
the trainer after each publish and polling in case it misses one. It holds a
`LocalRollouts`, the same inference side the ``local`` backend runs in-process, or with
``engine.kind = "vllm"`` a `VllmRollouts` on a vLLM server of its own (`vllm_worker`);
groups go back to the driver as wire messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
from collections.abc import Callable
from typing import Any

import msgspec
import structlog
import torch

from tandem.agent_env import EnvConfig
from tandem.moe_determinism import MoEConfig, MoETransformer, batch_invariant
from tandem.orchestrator.backends.ray.envs import EnvPools
from tandem.orchestrator.config import EngineConfig, EpisodeConfig, RunConfig, TaskConfig
from tandem.orchestrator.inference.embedded.engine import InferenceEngine
from tandem.orchestrator.inference.formats import chat_format_for
from tandem.orchestrator.rollout.local import LocalRollouts
from tandem.orchestrator.rollout.tasks import TaskSource
from tandem.orchestrator.rollout.vllm import VllmRollouts
from tandem.orchestrator.wire import RolloutStats, encode

log = structlog.get_logger()


class WorkerSpec(msgspec.Struct, kw_only=True):
    """Everything a rollout actor needs to build its engine and play groups. ``model.path``:
    the policy's directory, whose tokenizer and chat template (if it has them) the actor
    loads in its own process (`chat_format_for`), so it must be readable there."""

    model: MoEConfig
    engine: EngineConfig
    env: EnvConfig
    episode: EpisodeConfig
    tasks: TaskConfig
    task_seed: int
    task_offset: int
    seed: int
    group_size: int
    store_url: str
    env_pools: list[str] = []  # actor names; empty: local sandboxes

    @classmethod
    def for_run(
        cls, config: RunConfig, model: MoEConfig, tasks: TaskSource, store_url: str
    ) -> WorkerSpec:
        """The spec of a run's rollout engines: its engine, episodes and tasks on ``model``,
        following the stream at ``store_url``."""
        return cls(
            model=model,
            engine=config.engine,
            env=config.env,
            episode=config.episode,
            tasks=tasks.config,
            task_seed=tasks.seed,
            task_offset=tasks.offset,
            seed=config.run.seed,
            group_size=config.rl.group_size,
            store_url=store_url,
        )

    def task_source(self) -> TaskSource:
        return TaskSource(self.tasks, self.task_seed, offset=self.task_offset)

    def play_settings(self) -> dict[str, Any]:
        """How groups are played, as either kind of rollouts takes it."""
        return {
            "env": self.env,
            "episode": self.episode,
            "engine_cfg": self.engine,
            "seed": self.seed,
            "group_size": self.group_size,
        }


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """blake2b of every tensor's bit pattern in name order (equal digests: equal bits)."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(state):
        t = state[name].detach().contiguous().cpu()
        h.update(name.encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class RolloutWorker:
    """The body of a rollout actor (`RayRollouts` wraps it with ``ray.remote``)."""

    def __init__(
        self, spec: WorkerSpec, name: str, torch_threads: int, poll_s: float | None
    ) -> None:
        self.spec, self.name = spec, name
        self.torch_threads, self.poll_s = torch_threads, poll_s
        self.rollouts: LocalRollouts | VllmRollouts | None = None
        self._scope = contextlib.ExitStack()

    async def start(
        self,
        follow: bool = True,
        version: int | None = None,
        on_apply: Callable[[int], None] | None = None,
    ) -> int:
        """Build the engine and reach ``version`` (default: the newest) with one pull;
        returns it. With ``follow`` the engine also pulls each newer version by itself
        (otherwise only on `sync_to`). ``on_apply``: called (in the engine's thread) with
        each version an embedded engine applies after this one."""
        from tandem.agent_env import Env
        from tandem.delta_sync import Subscriber, open_store
        from tandem.orchestrator.runtime.allocator import reuse_freed_memory

        reuse_freed_memory()
        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        spec = self.spec
        chat = chat_format_for(spec.model.path)
        open_env = EnvPools.lookup(spec.env_pools, self.name) if spec.env_pools else Env
        if spec.engine.kind == "vllm":
            from tandem.orchestrator.backends.ray.vllm_worker import vllm_actor_rollouts

            self.rollouts = await vllm_actor_rollouts(
                spec, self.name, self._scope, version=version, chat=chat, open_env=open_env
            )
            await self.rollouts.start(follow=follow)
            log.info("rollouts.worker_ready", worker=self.name, version=self.rollouts.version)
            return self.rollouts.version
        self._scope.enter_context(batch_invariant(spec.engine.deterministic))
        model = MoETransformer(spec.model)
        engine = InferenceEngine(
            model, spec.engine, stop_id=chat.end_id, version=-1, vocab=chat.tok.vocab_size
        )
        subscriber = Subscriber(open_store(spec.store_url))
        prepared = await asyncio.to_thread(subscriber.prepare, version)
        engine.stage_update(prepared)
        engine.apply_pending()
        if on_apply is not None:
            engine.on_apply = lambda applied, _state: on_apply(applied)
        self.rollouts = LocalRollouts(
            engine,
            subscriber,
            spec.task_source(),
            **spec.play_settings(),
            chat=chat,
            poll_s=self.poll_s,
            open_env=open_env,
        )
        await self.rollouts.start(follow=follow)
        log.info("rollouts.worker_ready", worker=self.name, version=engine.version)
        return engine.version

    def _live(self) -> LocalRollouts | VllmRollouts:
        if self.rollouts is None:
            raise RuntimeError(f"rollout worker {self.name} was not started")
        return self.rollouts

    async def play(self, index: int, min_version: int) -> bytes:
        """The group as a wire message (`PlayedGroup`)."""
        return encode(await self._live().play(index, min_version))

    def published(self) -> None:
        self._live().published()

    async def sync_to(self, version: int) -> int:
        await self._live().sync_to(version)
        return self._live().version

    async def stats(self) -> RolloutStats:
        return await self._live().stats()

    def pid(self) -> int:
        return os.getpid()

    def digest(self) -> tuple[int, str]:
        """(version, digest of the engine's weights): lets a test check them bit for bit."""
        rollouts = self._live()
        if not isinstance(rollouts, LocalRollouts):
            raise RuntimeError(f"rollout worker {self.name}: a vLLM server's weights are its own")
        return rollouts.engine.version, state_digest(rollouts.engine.state)

    async def stop(self) -> None:
        if self.rollouts is not None:
            await self.rollouts.close()
        self._scope.close()
