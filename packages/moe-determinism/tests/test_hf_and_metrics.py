"""Must-hold 5 (Hugging Face layout, checked against transformers), traces and metrics."""

from __future__ import annotations

import math
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from tandem.moe_determinism import (
    MoEConfig,
    MoEDeterminismError,
    MoETransformer,
    RoutingTrace,
    compare_logprobs,
    deterministic_topk,
    load_hf,
    routing_agreement,
    save_hf,
)

CFG = MoEConfig(
    vocab_size=300,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    moe_intermediate_size=48,
    num_experts=6,
    num_experts_per_tok=2,
    kv_split_size=16,
)


def test_save_hf_loads_in_transformers_and_matches(tmp_path: Path) -> None:
    from transformers import Qwen3MoeForCausalLM

    m = MoETransformer(CFG)
    m.reset_parameters(seed=3)
    m.eval()
    save_hf(m, tmp_path)
    hf = Qwen3MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(0, CFG.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, ref = m(ids).logits, hf(ids).logits
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)

    back = load_hf(tmp_path)
    assert back.config == m.config
    for (name, a), (_, b) in zip(m.state_dict().items(), back.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_load_hf_rejects_other_models(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(MoEDeterminismError, match="qwen3_moe"):
        load_hf(tmp_path)
    with pytest.raises(MoEDeterminismError, match=r"config\.json"):
        load_hf(tmp_path / "missing")


def test_routing_trace_roundtrip_and_compactness() -> None:
    ids = np.random.default_rng(0).integers(0, 6, size=(11, 3, 2))
    t = RoutingTrace.from_ids(ids, num_experts=6)
    assert t.expert_ids.dtype == np.uint8 and len(t.data) == ids.size
    assert RoutingTrace.from_msgpack(t.to_msgpack()) == t
    assert msgspec.json.decode(msgspec.json.encode(t), type=RoutingTrace) == t
    assert np.array_equal(RoutingTrace.concat([t.slice(0, 4), t.slice(4, 11)]).expert_ids, ids)
    big = RoutingTrace.from_ids(np.full((2, 1, 1), 300), num_experts=384)
    assert big.expert_ids.dtype == np.uint16 and int(big.expert_ids[0, 0, 0]) == 300
    with pytest.raises(MoEDeterminismError):
        RoutingTrace.from_ids(np.zeros((3, 2)), num_experts=4)
    with pytest.raises(MoEDeterminismError):
        RoutingTrace.from_ids(np.full((1, 1, 1), 9), num_experts=4)


def test_deterministic_topk_breaks_ties_to_lower_id() -> None:
    probs = torch.tensor([[0.1, 0.3, 0.3, 0.3], [0.4, 0.1, 0.4, 0.1]])
    assert deterministic_topk(probs, 2).tolist() == [[1, 2], [0, 2]]
    assert deterministic_topk(probs, 1).tolist() == [[1], [0]]


def test_compare_logprobs_against_formulas() -> None:
    a = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    b = torch.tensor([-1.0, -2.5, -0.25, -9.0])
    mask = torch.tensor([True, True, True, False])
    r = compare_logprobs(a, b, mask)
    d = [0.0, 0.5, -0.25]
    assert r.tokens == 3
    assert r.max_abs_diff == pytest.approx(0.5)
    assert r.mean_abs_diff == pytest.approx(0.25)
    assert r.kl_k1 == pytest.approx(sum(d) / 3)
    assert r.kl_k3 == pytest.approx(sum(math.exp(-x) - 1 + x for x in d) / 3)
    assert r.frac_tokens_differ == pytest.approx(2 / 3)
    same = compare_logprobs(a, a.clone())
    assert (same.max_abs_diff, same.kl_k3, same.frac_tokens_differ) == (0.0, 0.0, 0.0)


def test_routing_agreement_counts_decisions_and_tokens() -> None:
    a = np.array([[[0, 1], [2, 3]], [[0, 1], [2, 3]], [[4, 5], [0, 1]]])
    b = np.array([[[1, 0], [2, 3]], [[0, 2], [2, 3]], [[4, 5], [0, 3]]])
    r = routing_agreement(a, b)
    assert r.per_decision == pytest.approx(4 / 6)
    assert r.per_token == pytest.approx(1 / 3)
    with pytest.raises(MoEDeterminismError):
        routing_agreement(a, b[:2])
