"""Each family's router against transformers' own gate module, and Llama 3's RoPE
frequencies against transformers' own function (the independent computations).

The grouped sigmoid router (DeepSeek-V3, Kimi K2) must choose the experts transformers'
`DeepseekV3TopkRouter` chooses (correction bias, group limit) and weigh them with the
chosen experts' unbiased scores, normalised and scaled; replaying the chosen ids must give
the same weights bit for bit, with the gradient reaching the router.
"""

from __future__ import annotations

import pytest
import torch

from tandem.moe_determinism.model.config import RopeScaling
from tandem.moe_determinism.model.rope import inverse_frequencies
from tandem.moe_determinism.routing import route


def _sorted_by_id(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.argsort(dim=-1)
    return ids.gather(-1, order), weights.gather(-1, order)


@pytest.mark.parametrize(
    ("experts", "top_k", "n_group", "topk_group", "normalize", "scale"),
    [(16, 4, 4, 2, True, 2.5), (8, 2, 1, 1, False, 1.0), (12, 3, 3, 1, True, 1.8)],
)
def test_grouped_sigmoid_router_matches_transformers_gate(
    experts: int, top_k: int, n_group: int, topk_group: int, normalize: bool, scale: float
) -> None:
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    hidden = 24
    cfg = DeepseekV3Config(
        hidden_size=hidden,
        n_routed_experts=experts,
        num_experts_per_tok=top_k,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=normalize,
        routed_scaling_factor=scale,
    )
    gate = DeepseekV3TopkRouter(cfg)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(experts, hidden, generator=gen) * 0.5)
        gate.e_score_correction_bias.copy_(torch.randn(experts, generator=gen) * 0.2)
    x = torch.randn(200, hidden, generator=gen)
    with torch.no_grad():
        logits, their_w, their_ids = gate(x)
    their_ids, their_w = _sorted_by_id(their_ids, their_w)

    kw = dict(
        kind="grouped_sigmoid",
        bias=gate.e_score_correction_bias,
        n_group=n_group,
        topk_group=topk_group,
        scale=scale,
    )
    free = route(logits, top_k, normalize, **kw)
    assert torch.equal(free.ids, their_ids)
    torch.testing.assert_close(free.weights, their_w, rtol=1e-6, atol=1e-7)
    # the bias changes the choice (else this test would not see it) but not the weights
    unbiased = route(logits, top_k, normalize, **{**kw, "bias": None})
    assert not torch.equal(unbiased.ids, free.ids)

    live = logits.clone().requires_grad_(True)
    replayed = route(live, top_k, normalize, free.ids, **kw)
    assert torch.equal(replayed.ids, free.ids)
    assert torch.equal(replayed.weights.detach(), free.weights)
    replayed.weights.sum().backward()
    assert live.grad is not None and bool(live.grad.abs().sum() > 0)


def test_softmax_router_matches_mixtral_gate() -> None:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    cfg = MixtralConfig(hidden_size=24, num_local_experts=8, num_experts_per_tok=2)
    gate = MixtralTopKRouter(cfg)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(8, 24, generator=gen) * 0.5)
    x = torch.randn(200, 24, generator=gen)
    with torch.no_grad():
        logits, their_w, their_ids = gate(x)
    their_ids, their_w = _sorted_by_id(their_ids, their_w)
    free = route(logits, 2, True)
    assert torch.equal(free.ids, their_ids)
    torch.testing.assert_close(free.weights, their_w, rtol=1e-6, atol=1e-7)
    assert torch.equal(route(logits, 2, True, free.ids).weights, free.weights)


@pytest.mark.parametrize("original", [64, 256, 8192])
def test_llama3_rope_frequencies_match_transformers(original: int) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
    cfg = LlamaConfig(
        hidden_size=512,
        num_attention_heads=8,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "original_max_position_embeddings": original,
            **params,
        },
    )
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    ours = inverse_frequencies(
        64, 500000.0, RopeScaling(original_max_position_embeddings=original, **params)
    )
    assert torch.equal(ours, theirs)
    plain = inverse_frequencies(64, 500000.0, None)
    assert not torch.equal(ours, plain)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        (dict(model_type="llama", kv_lora_rank=8), "kv_lora_rank"),
        (dict(model_type="qwen2", attention_bias=True), "attention_bias"),
        (dict(model_type="qwen2", hidden_size=64, head_dim=32), "hidden_size / num_attention"),
        (dict(model_type="mixtral", norm_topk_prob=False), "renormalises"),
        (dict(model_type="mixtral", shared_expert_intermediate_size=8), "no shared expert"),
        (dict(model_type="qwen3_moe", n_group=2), "grouped"),
        (dict(model_type="deepseek_v3", kv_lora_rank=0), "kv_lora_rank"),
        (dict(model_type="deepseek_v3", n_group=3), r"n_group \(3\) must divide"),
        (dict(model_type="deepseek_v3", n_group=4, topk_group=1, num_experts_per_tok=3), "exceeds"),
    ],
)
def test_config_refuses_what_a_family_does_not_have(fields: dict, named: str) -> None:
    from tandem.moe_determinism import MoEConfig, MoEDeterminismError

    mla = dict(kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    base = mla if fields["model_type"] == "deepseek_v3" else {}
    with pytest.raises(MoEDeterminismError, match=named):
        MoEConfig(**{**base, **fields})


def test_rope_scaling_refuses_a_bad_factor_and_other_kinds() -> None:
    from tandem.moe_determinism import MoEDeterminismError

    with pytest.raises(MoEDeterminismError, match="factor"):
        RopeScaling(factor=-1.0)
    with pytest.raises(MoEDeterminismError, match=r"'yarn'.*llama3"):
        RopeScaling(rope_type="yarn")
