"""Shared pieces of the RL pipeline tests: a tiny model and run, and a parity reward.

The episodes are real (sandbox, hidden tests); the reward is replaced by a parity of the
generated tokens so that a random tiny policy still yields groups with different rewards.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tandem.orchestrator.config import (
    EngineConfig,
    EnvSettings,
    ModelConfig,
    RLConfig,
    TaskConfig,
    TrainerConfig,
)
from tandem.orchestrator.policy import build_model
from tandem.orchestrator.rl import RLRun, RunHooks
from tandem.orchestrator.tasks import TaskSource
from tandem.orchestrator.tokenizer import ByteTokenizer
from tandem.orchestrator.weights import weights_equal

TINY = ModelConfig(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    moe_intermediate_size=32,
    num_experts=4,
    kv_split_size=16,
)
ENGINE = EngineConfig(max_slots=8, max_len=1024, max_new_tokens=6)
ENV = EnvSettings(max_turns=1, allow_unsandboxed=True)


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


def tiny_run(
    tmp_path: Path,
    rl: RLConfig,
    hooks: RunHooks,
    *,
    env: EnvSettings = ENV,
    check_rows: int = 0,
    processes: int = 1,
    tasks: TaskSource | None = None,
) -> RLRun:
    return RLRun(
        build_model(TINY, ByteTokenizer()),
        rl=rl,
        trainer=TrainerConfig(lr=1e-2, routing_check_rows=check_rows, processes=processes),
        engine=ENGINE,
        env=env,
        tasks=tasks or TaskSource(TaskConfig(), 1),
        run_dir=tmp_path,
        hooks=hooks,
    )
