"""RL on the ``ray`` backend with vLLM: the rollout actor starts a vLLM server of its own on
the version it joins at, the server follows the weight stream through tandem's plugin, and
every step trains and publishes (a Ray cluster started by the run on loopback)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgspec
import pytest
import torch
from vllm_helpers import ENGINE, MODEL

from tandem.moe_determinism import MoETransformer

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")  # workers use this interpreter
pytest.importorskip("ray")


def test_each_rollout_actor_plays_on_a_vllm_server_of_its_own(tmp_path: Path) -> None:
    from rl_helpers import ENV, parity

    from tandem.orchestrator import RunConfig, reinforce
    from tandem.orchestrator.config import (
        RayConfig,
        RLConfig,
        RunSettings,
        TaskConfig,
        TrainerConfig,
    )
    from tandem.orchestrator.rl.hooks import RunHooks

    config = RunConfig(
        run=RunSettings(name="vllm-ray", output_dir=str(tmp_path)),
        model=MODEL,
        tasks=TaskConfig(),
        env=ENV,
        engine=msgspec.structs.replace(ENGINE, max_new_tokens=8),
        trainer=TrainerConfig(lr=1e-2, routing_check_rows=2),
        rl=RLConfig(
            backend="ray",
            mode="sync",  # each step's groups are played on the version before it
            steps=2,
            group_size=4,
            groups_per_step=1,
            checkpoint_every=2,
            ray=RayConfig(num_cpus=3, workers=1, worker_cpus=1, poll_s=0.5, torch_threads=1),
        ),
    )
    torch.manual_seed(3)
    policy = MoETransformer(MODEL).eval()
    published: list[int] = []
    summary = reinforce(
        policy,
        config,
        run_dir=tmp_path / "rl",
        task_offset=0,
        hooks=RunHooks(reward=parity, on_publish=lambda v, _: published.append(v)),
    )
    assert summary.steps_done == 2 and summary.policy_version == 2
    assert published == [1, 2]
    records = [json.loads(line) for line in (tmp_path / "rl" / "metrics.jsonl").open()]
    assert {r["trainer_replay"] for r in records} == {"R2"}  # vLLM on a CPU: no routes
    assert [r["engine_version"] for r in records] == [0, 1]  # the actor's server followed
    gaps = [r["mismatch_max_abs"] for r in records if r.get("mismatch_max_abs") is not None]
    assert gaps and max(gaps) < 1e-3  # fp32 vLLM against the trainer's batch-invariant ops
