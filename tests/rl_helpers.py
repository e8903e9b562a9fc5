"""Shared pieces of the RL pipeline tests: a tiny model and run, and a parity reward.

The episodes are real (sandbox, hidden tests); the reward is replaced by a parity of the
generated tokens so that a random tiny policy still yields groups with different rewards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tandem.agent_env import EnvConfig
from tandem.moe_determinism import MoEConfig, MoETransformer
from tandem.orchestrator.backends import build_backend
from tandem.orchestrator.config import (
    EngineConfig,
    RLConfig,
    RunConfig,
    RunSettings,
    TaskConfig,
    TrainerConfig,
)
from tandem.orchestrator.inference.tokenizer import ByteTokenizer
from tandem.orchestrator.policy import build_model
from tandem.orchestrator.protocols import Backend, BackendStart
from tandem.orchestrator.rl.hooks import RunHooks
from tandem.orchestrator.rl.loop import RLRun
from tandem.orchestrator.rl.summary import RunSummary
from tandem.orchestrator.rollout.curriculum import CuratedCursor
from tandem.orchestrator.rollout.tasks import TaskSource
from tandem.orchestrator.training.weights import weights_equal

TINY = MoEConfig(
    vocab_size=266,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    moe_intermediate_size=32,
    num_experts=4,
    max_position_embeddings=4096,
    kv_split_size=16,
)
ENGINE = EngineConfig(max_slots=8, max_len=1024, max_new_tokens=6)
ENV = EnvConfig(
    max_turns=1,
    allow_unsandboxed=True,
    episode_wall_s=300.0,
    grade_timeout_s=60.0,
    system_prompt="Fix the bug with the tools, run the tests, then submit.",
)


def parity(sample) -> float:
    return float(sum(sample.tokens[-len(sample.tokens) // 3 :]) % 2)


class WeightRecorder:
    """Hooks that keep every published state and check each engine update against it."""

    def __init__(self) -> None:
        self.published: dict[int, dict[str, torch.Tensor]] = {}
        self.applied: dict[int, bool] = {}

    def on_publish(self, version: int, state: dict[str, torch.Tensor]) -> None:
        self.published[version] = {k: v.clone() for k, v in state.items()}

    def on_apply(self, version: int, state: dict[str, torch.Tensor]) -> None:
        # The trainer publishes version v before the engine can pull it.
        self.applied[version] = weights_equal(state, self.published[version])


class TinyRun:
    """An RL run as the ``reinforce`` stage builds it (tasks from 0 of the config's training
    seed, metrics and checkpoints in ``run_dir``), keeping the pieces for tests to look at:
    the policy, the loop, the task cursor and the backend it built last."""

    def __init__(
        self,
        policy: MoETransformer,
        config: RunConfig,
        run_dir: Path,
        hooks: RunHooks,
        tasks: TaskSource | None = None,
    ) -> None:
        self.policy, self.config, self.run_dir = policy, config, Path(run_dir)
        self.tasks = tasks or TaskSource(config.tasks, config.tasks.train_seed)
        self.cursor = CuratedCursor(self.tasks, config.rl.curriculum, config.run.seed)
        self.backend: Any = None
        self.loop = RLRun(self._build, self.cursor, rl=config.rl, run_dir=self.run_dir, hooks=hooks)

    def _build(self, start: BackendStart) -> Backend:
        self.backend = build_backend(
            start, policy=self.policy, config=self.config, tasks=self.tasks, run_dir=self.run_dir
        )
        return self.backend

    def run(self) -> RunSummary:
        return self.loop.run()

    @property
    def rollouts(self) -> Any:
        return self.backend.rollouts

    @property
    def name(self) -> str:
        return self.config.run.name


def tiny_config(
    run_dir: Path,
    rl: RLConfig,
    *,
    env: EnvConfig = ENV,
    check_rows: int = 0,
    processes: int = 1,
    tasks: TaskConfig | None = None,
    model: MoEConfig = TINY,
) -> RunConfig:
    return RunConfig(
        run=RunSettings(name=Path(run_dir).name, output_dir=str(Path(run_dir).parent)),
        model=model,
        tasks=tasks or TaskConfig(),
        env=env,
        engine=ENGINE,
        trainer=TrainerConfig(lr=1e-2, routing_check_rows=check_rows, processes=processes),
        rl=rl,
    )


def tiny_run(
    tmp_path: Path, rl: RLConfig, hooks: RunHooks, *, tasks: TaskSource | None = None, **kw: Any
) -> TinyRun:
    """A `TinyRun` of `tiny_config` (``kw``: its keywords) on a fresh tiny policy."""
    config = tiny_config(tmp_path, rl, tasks=tasks.config if tasks is not None else None, **kw)
    policy = build_model(config.model, ByteTokenizer())
    return TinyRun(policy, config, tmp_path, hooks, tasks)
