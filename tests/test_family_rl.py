"""Every model family through RL: the embedded engine plays real episodes, the trainer takes
GRPO steps with router replay, each step's weights are published as deltas and applied to the
engine bit for bit, and the exported policy is what transformers loads.

Tiny models of each family (Llama with Llama 3 RoPE, Mistral, Qwen2, Mixtral, DeepSeek-V3
with MLA and grouped routing) built from their configs; the checks are the pipeline's own:
engine = trainer log-probs (mismatch 0 on the checked rows), routing agreement 1.0 under
replay, and every applied version equal to the published one.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch
from rl_helpers import TINY, WeightRecorder, parity, tiny_run

from tandem.moe_determinism.model.config import RopeScaling
from tandem.orchestrator.artifacts.metrics import read_metrics
from tandem.orchestrator.config import RLConfig
from tandem.orchestrator.policy import save_policy
from tandem.orchestrator.rl.hooks import RunHooks

DENSE = dict(num_experts=0, num_experts_per_tok=0, intermediate_size=48)
FAMILIES = {
    "llama": msgspec.structs.replace(
        TINY,
        model_type="llama",
        rope_theta=500000.0,
        rope_scaling=RopeScaling(original_max_position_embeddings=512),
        **DENSE,
    ),
    "mistral": msgspec.structs.replace(TINY, model_type="mistral", **DENSE),
    "qwen2": msgspec.structs.replace(TINY, model_type="qwen2", tie_word_embeddings=True, **DENSE),
    "mixtral": msgspec.structs.replace(TINY, model_type="mixtral", num_experts_per_tok=2),
    "deepseek_v3": msgspec.structs.replace(
        TINY,
        model_type="deepseek_v3",
        num_hidden_layers=3,
        num_key_value_heads=4,
        head_dim=4,
        num_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        intermediate_size=48,
        shared_expert_intermediate_size=32,
        q_lora_rank=16,
        kv_lora_rank=12,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
        rope_interleave=True,
    ),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_rl_steps_engine_equals_trainer_and_export_loads(tmp_path: Path, family: str) -> None:
    from transformers import AutoModelForCausalLM

    model = FAMILIES[family]
    sync = WeightRecorder()
    hooks = RunHooks(on_publish=sync.on_publish, on_engine_update=sync.on_apply, reward=parity)
    rl = RLConfig(
        mode="async",
        steps=2,
        group_size=3,
        groups_per_step=1,
        max_staleness=1,
        rollout_workers=3,
        checkpoint_every=2,
        torch_threads=1,
    )
    run = tiny_run(tmp_path, rl, hooks, check_rows=2, model=model)
    summary = run.run()

    assert summary.steps_done == 2 and sorted(sync.published) == [1, 2]
    assert sync.applied and all(sync.applied.values()), sync.applied
    records = read_metrics(tmp_path / "metrics.jsonl")
    checked = [r for r in records if r.get("mismatch_tokens")]
    assert checked, "no step checked engine against trainer log-probs"
    assert all(r["mismatch_max_abs"] == 0.0 for r in checked)
    if model.moe_layers:
        assert all(r["routing_agreement_replay"] == 1.0 for r in records)

    out = save_policy(run.policy, tmp_path / "exported", stage="test")
    back = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert back.config.model_type == family
    ids = torch.randint(0, 266, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = torch.log_softmax(run.policy.float()(ids).logits, -1)
        theirs = torch.log_softmax(back(ids).logits, -1)
    assert float((ours - theirs).abs().max()) <= 2e-5
