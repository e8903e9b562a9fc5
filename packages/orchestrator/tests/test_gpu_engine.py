"""On a GPU: the embedded engine's log-probs equal the trainer's bit for bit with the demo's
model on CUDA, and a 2-step RL run trains on the GPU and publishes each version."""

from __future__ import annotations

import tomllib
from pathlib import Path

import msgspec
import pytest
import torch
from rl_helpers import WeightRecorder, parity, tiny_run

from tandem.moe_determinism import MoEConfig, batch_invariant
from tandem.orchestrator.artifacts.metrics import read_metrics
from tandem.orchestrator.config import RLConfig, TrainerConfig
from tandem.orchestrator.policy import build_model
from tandem.orchestrator.rl.hooks import RunHooks
from tandem.orchestrator.training.collate import collate
from tandem.orchestrator.training.scoring import score
from tandem.orchestrator.training.trainer import RLTrainer

pytestmark = pytest.mark.gpu
DEMO = Path(__file__).resolve().parents[3] / "configs" / "demo.toml"


def _demo_policy(chat):
    model = msgspec.convert(tomllib.loads(DEMO.read_text())["model"], MoEConfig)
    return build_model(model, chat.tok, seed=0).cuda()


def _episodes(chat, h, n: int):
    return [
        (h.prompt(chat, f"fix task {i}: " + "x" * (7 * i)), [h.observation(chat, "ok " * i)], i)
        for i in range(n)
    ]


def test_engine_logprobs_equal_trainer_bit_for_bit_on_cuda(chat, make_engine, helpers) -> None:
    policy = _demo_policy(chat)
    engine = make_engine(policy)
    assert next(engine.model.parameters()).is_cuda
    samples = helpers.drive(engine, chat, _episodes(chat, helpers, 6))
    batch = collate([samples[:3], samples[3:]]).to("cuda")
    with torch.no_grad(), batch_invariant():
        replayed, _, _ = score(policy, batch, "R3")
        free, free_ids, counts = score(policy, batch, "none")
    mask = batch.loss_mask
    assert int(mask.sum()) > 20
    rollout_bits = batch.rollout_logprobs[mask].view(torch.int32)
    assert torch.equal(replayed[mask].view(torch.int32), rollout_bits)
    assert torch.equal(free[mask].view(torch.int32), rollout_bits)
    recorded = torch.cat([batch.extras["routes"][i, :n].long() for i, n in enumerate(counts)])
    assert torch.equal(free_ids.sort(-1).values.cpu(), recorded.sort(-1).values.cpu())
    trainer = RLTrainer(policy, TrainerConfig(lr=1e-3, routing_check_rows=4))
    metrics = trainer.step([samples[:3], samples[3:]], 0)
    assert next(policy.parameters()).is_cuda and metrics["step_applied"] == 1.0
    assert metrics["mismatch_tokens"] > 0 and metrics["mismatch_max_abs"] == 0.0
    assert metrics["routing_agreement_free"] == 1.0


def test_two_rl_steps_train_on_the_gpu_and_publish(tmp_path: Path) -> None:
    sync = WeightRecorder()
    hooks = RunHooks(on_publish=sync.on_publish, on_engine_update=sync.on_apply, reward=parity)
    rl = RLConfig(mode="sync", steps=2, group_size=2, groups_per_step=1, rollout_workers=2)
    run = tiny_run(tmp_path, rl, hooks, check_rows=2)
    before = {k: v.detach().cpu().clone() for k, v in run.policy.state_dict().items()}
    summary = run.run()
    assert summary.steps_done == 2 and summary.policy_version == 2
    assert next(run.policy.parameters()).is_cuda  # trained where the GPU is
    after = run.policy.state_dict()
    assert any(not torch.equal(before[k], after[k].cpu()) for k in before)
    assert sorted(sync.published) == [1, 2]
    assert all(t.is_cuda for t in sync.published[2].values())
    assert sync.applied and all(sync.applied.values()), sync.applied  # engine == trainer
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    assert all(r["sync_bytes"] > 0 for r in records)
    assert all(r["mismatch_max_abs"] == 0.0 for r in records if r.get("mismatch_tokens"))
