"""A short RL run on Hugging Face checkpoints built here: dense Qwen3 (no routers) and
Qwen3-MoE with a dense layer (routes for the MoE layers only, replayed to the trainer).

Per step the engine's weights equal the trainer's bit for bit after each weight pull, and
where the trainer re-scores the rollouts the log-probs agree bit for bit (replayed routes
included). The reward is a parity of the generated tokens, so a random policy gets groups
with different rewards.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from tandem.agent_env import EnvConfig
from tandem.orchestrator import RunConfig, reinforce
from tandem.orchestrator.artifacts.metrics import read_metrics
from tandem.orchestrator.inference.tokenizer import ByteTokenizer
from tandem.orchestrator.policy import build_model
from tandem.orchestrator.rl.hooks import RunHooks
from tandem.orchestrator.training.weights import weights_equal

SHAPES = dict(
    vocab_size=266,  # the byte tokenizer's
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
)


def _checkpoint(kind: str, path: Path) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**SHAPES))
    else:
        moe = dict(moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2)
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**SHAPES, **moe, mlp_only_layers=[0]))
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_rl_steps_on_a_checkpoint_keep_engine_and_trainer_equal(kind: str, tmp_path: Path) -> None:
    ckpt = _checkpoint(kind, tmp_path / "ckpt")
    config = msgspec.convert(
        {
            "run": {"output_dir": str(tmp_path), "name": "rl"},
            "model": {"path": str(ckpt), "kv_split_size": 16},
            "env": msgspec.to_builtins(
                EnvConfig(max_turns=1, allow_unsandboxed=True, episode_wall_s=120.0)
            ),
            "tasks": {"functions": ["gcd"], "functions_per_repo": 1},
            "engine": {"max_slots": 4, "max_len": 1024, "max_new_tokens": 6},
            "trainer": {"lr": 1e-2, "routing_check_rows": 2},
            "rl": {
                "mode": "sync",
                "steps": 2,
                "group_size": 2,
                "groups_per_step": 1,
                "rollout_workers": 1,
                "checkpoint_every": 2,
                "torch_threads": 1,
            },
        },
        RunConfig,
    )
    published: dict[int, dict[str, torch.Tensor]] = {}
    applied: dict[int, bool] = {}
    hooks = RunHooks(
        on_publish=lambda v, s: published.__setitem__(v, {k: t.clone() for k, t in s.items()}),
        on_engine_update=lambda v, s: applied.__setitem__(v, weights_equal(s, published[v])),
        reward=lambda sample: float(sum(sample.tokens[-len(sample.tokens) // 3 :]) % 2),
    )
    policy = build_model(config.model, ByteTokenizer())
    summary = reinforce(policy, config, run_dir=tmp_path / "rl_dir", task_offset=0, hooks=hooks)
    assert summary.steps_done == 2 and sorted(published) == [1, 2]
    assert applied and all(applied.values()), applied
    records = read_metrics(tmp_path / "rl_dir" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    checked = [r for r in records if r.get("mismatch_tokens")]
    assert checked, "the trainer re-scored no rollout tokens"
    assert all(r["mismatch_max_abs"] == 0.0 for r in checked)
    if kind == "qwen3_moe":
        assert all(r["routing_agreement_replay"] == 1.0 for r in records)
    else:  # no routers: nothing to compare, and no NaN reported
        assert all("routing_agreement_replay" not in r for r in records)
