"""Llama, Mistral, Qwen2, Mixtral and DeepSeek-V3 checkpoints, written here by transformers.

Each tiny random checkpoint is loaded by `load_hf` and scored against transformers on the
same weights (the independent computation); under `batch_invariant()` a KV-cache decode
(the engine's path) equals a packed forward (the trainer's) bit for bit; the MoE families
replay their recorded routes to the same bits; `save_hf` writes what transformers reads back
to the same logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.moe_determinism import (
    RouterReplay,
    RoutingTrace,
    batch_invariant,
    load_hf,
    save_hf,
    target_logprobs,
)

VOCAB = 96
FP32_TOL = 2e-5
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=40,
    max_position_embeddings=256,
)
DEEPSEEK = dict(
    COMMON,
    num_key_value_heads=4,
    moe_intermediate_size=16,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    n_shared_experts=1,
    kv_lora_rank=12,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=6,
    routed_scaling_factor=2.5,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # short, so the tiny head's four frequencies fall in all three bands of the scaling
    "original_max_position_embeddings": 256,
}
# case -> (transformers config class, model class, config fields, MoE layers)
CASES: dict[str, tuple[str, dict[str, Any], tuple[int, ...]]] = {
    "llama_gqa_llama3_rope_untied": (
        "Llama",
        dict(COMMON, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False),
        (),
    ),
    "llama_tied_attention_bias": (
        "Llama",
        dict(COMMON, tie_word_embeddings=True, attention_bias=True, rope_theta=100000.0),
        (),
    ),
    "mistral": ("Mistral", dict(COMMON, head_dim=8, sliding_window=None), ()),
    "qwen2_qkv_bias": ("Qwen2", dict(COMMON, tie_word_embeddings=True), ()),
    "mixtral": (
        "Mixtral",
        dict(COMMON, num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
        (0, 1, 2),
    ),
    "deepseek_v3_q_lora": ("DeepseekV3", dict(DEEPSEEK, q_lora_rank=16), (1, 2)),
    "deepseek_v3_no_q_lora": ("DeepseekV3", dict(DEEPSEEK, q_lora_rank=None), (1, 2)),
}


def _hf_model(family: str, fields: dict[str, Any]) -> torch.nn.Module:
    import transformers

    config = getattr(transformers, f"{family}Config")(**fields)
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():  # larger than the default init, so every layer moves the logits
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.15 * noise)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a bias that changes the choice
                b.copy_(0.3 * torch.randn(b.shape, generator=gen))
    return model.eval()


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    name = request.param
    family, fields, _ = CASES[name]
    hf = _hf_model(family, fields)
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path)
    return name, hf, path


def _ids(rows: int = 3, length: int = 40) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(1))


def _logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return target_logprobs(logits[..., :-1, :], ids[..., 1:])


def test_config_reads_the_family(checkpoint) -> None:
    name, hf, path = checkpoint
    model = load_hf(path)
    assert model.config.model_type == hf.config.model_type
    assert model.config.moe_layers == CASES[name][2]
    assert (model.lm_head.weight is model.embed_tokens.weight) == model.config.tie_word_embeddings


def test_logprobs_match_transformers_fp32(checkpoint) -> None:
    name, hf, path = checkpoint
    ids = _ids()
    ours = load_hf(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = _logprobs(hf.float()(ids).logits, ids)
        plain = _logprobs(ours(ids).logits, ids)
        with batch_invariant():
            inv = _logprobs(ours(ids).logits, ids)
    for got in (plain, inv):
        diff = float((got - ref).abs().max())
        print(f"{name} fp32 max|dlogprob| = {diff:.2e}")
        assert diff <= FP32_TOL, (name, diff)


def test_engine_decode_equals_trainer_forward_bitwise(checkpoint) -> None:
    """The engine's path (prefill then one token at a time through the KV cache, two
    sequences sharing the batch) against the trainer's (one packed pass), same bits."""
    _, _, path = checkpoint
    model = load_hf(path).eval()
    seqs = [_ids(1, 37)[0], _ids(1, 21)[0].flip(0)]
    with torch.no_grad(), batch_invariant():
        packed = model(torch.cat(seqs), cu_seqlens=[0, 37, 58])
        cache = model.new_cache(max_slots=2, max_len=64)
        first = model(torch.stack([seqs[0][:9], seqs[1][:9]]), cache=cache, slots=[1, 0])
        steps = [first.logits]
        for t in range(9, 37):
            live = [i for i in range(2) if t < len(seqs[i])]
            ids = torch.stack([seqs[i][t : t + 1] for i in live])
            out = model(ids, cache=cache, slots=[1 - i for i in live])
            full = torch.zeros(2, 1, VOCAB)
            for j, i in enumerate(live):
                full[i] = out.logits[j]
            steps.append(full)
    decoded = torch.cat(steps, dim=1)
    assert torch.equal(decoded[0], packed.logits[:37])
    assert torch.equal(decoded[1, :21], packed.logits[37:])


def test_replayed_routes_give_the_same_bits(checkpoint) -> None:
    name, _, path = checkpoint
    moe_layers = CASES[name][2]
    model = load_hf(path).eval()
    top_k = model.config.num_experts_per_tok
    ids, lengths = _ids(), torch.tensor([40, 23, 11])
    with torch.no_grad(), batch_invariant():
        free = model(ids, lengths)
        replayed = {
            mode: model(ids, lengths, routing=RouterReplay(free.traces(), mode))
            for mode in ("R2", "R3")
        }
    assert free.route_ids.shape == (74, len(moe_layers), top_k if moe_layers else 0)
    for out in replayed.values():
        assert torch.equal(out.logits, free.logits)
    if moe_layers:  # other routes, forced, change the result: the replay is really used
        experts = model.config.num_experts
        shifted = ((free.route_ids + 1) % experts).split(free.counts)
        other = [RoutingTrace.from_ids(t, experts) for t in shifted]
        with torch.no_grad(), batch_invariant():
            forced = model(ids, lengths, routing=RouterReplay(other, "R3"))
        assert not torch.equal(forced.logits, free.logits)


def test_save_hf_roundtrip_loads_in_transformers(checkpoint, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    name, hf, path = checkpoint
    ours = load_hf(path).eval()
    save_hf(ours, tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(back) is type(hf)
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(back(ids).logits, hf(ids).logits), name
    again = load_hf(tmp_path)
    assert again.config == ours.config
    for (k, a), (_, b) in zip(ours.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
