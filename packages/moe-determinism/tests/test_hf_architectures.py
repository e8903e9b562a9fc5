"""Hugging Face checkpoints of each supported architecture, built here with transformers.

Qwen3-MoE with dense layers (``mlp_only_layers``, ``decoder_sparse_step``), tied and untied
embeddings, both ``norm_topk_prob`` settings, sharded with an index, and dense Qwen3: each
is loaded by `load_hf` and scored against transformers on the same weights (the independent
computation), saved back by `save_hf` and read by transformers again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.moe_determinism import (
    MoEConfig,
    MoEDeterminismError,
    MoETransformer,
    RouterReplay,
    batch_invariant,
    load_hf,
    save_hf,
    target_logprobs,
)

VOCAB = 96
FP32_TOL = 1e-5
# bf16 keeps 8 bits of mantissa: logits of a few units carry errors of ~1e-2, and a token
# whose experts flip between near-tied scores moves by a few tenths
BF16_DENSE_TOL = 1e-2
BF16_MAX_TOL = 0.5

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=40,
    rope_theta=10000.0,
)
ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    # layer 1 dense by mlp_only_layers, tied embeddings, sharded
    "moe_mlp_only_tied": (
        "qwen3_moe",
        dict(
            moe_intermediate_size=24,
            num_experts=4,
            num_experts_per_tok=2,
            mlp_only_layers=[1],
            norm_topk_prob=True,
            tie_word_embeddings=True,
        ),
    ),
    # layers 1 and 3 MoE by decoder_sparse_step, untied, unnormalised gate weights
    "moe_sparse_step_untied": (
        "qwen3_moe",
        dict(
            moe_intermediate_size=24,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=2,
            norm_topk_prob=False,
            tie_word_embeddings=False,
        ),
    ),
    "dense_qwen3_untied": ("qwen3", dict(tie_word_embeddings=False)),
    "dense_qwen3_tied": ("qwen3", dict(tie_word_embeddings=True)),
}
MOE_LAYERS = {
    "moe_mlp_only_tied": (0, 2, 3),
    "moe_sparse_step_untied": (1, 3),
    "dense_qwen3_untied": (),
    "dense_qwen3_tied": (),
}


def _hf_model(kind: str, extra: dict[str, Any]) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**COMMON, **extra))
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**COMMON, **extra))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():  # larger than the default init, so every layer moves the logits
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.15 * noise)
    return model.eval()


@pytest.fixture(scope="module", params=sorted(ARCHS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    name = request.param
    kind, extra = ARCHS[name]
    hf = _hf_model(kind, extra)
    path = tmp_path_factory.mktemp(name)
    # sharded (several files + model.safetensors.index.json) for the MoE checkpoints
    hf.save_pretrained(path, max_shard_size="40KB" if kind == "qwen3_moe" else "10GB")
    return name, hf, path


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, 20), generator=torch.Generator().manual_seed(1))


def _logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return target_logprobs(logits[:, :-1], ids[:, 1:])


def test_checkpoint_layout_is_what_the_case_says(checkpoint) -> None:
    name, _, path = checkpoint
    if ARCHS[name][0] == "qwen3_moe":
        assert (path / "model.safetensors.index.json").exists()
        assert len(list(path.glob("model-*.safetensors"))) > 1
    model = load_hf(path)
    assert model.config.moe_layers == MOE_LAYERS[name]
    assert model.config.tie_word_embeddings == ARCHS[name][1]["tie_word_embeddings"]
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


def test_logprobs_bf16_as_close_to_fp32_as_transformers_own_bf16(checkpoint) -> None:
    """Dense models: the same bf16 ops as transformers, so the same log-probs up to
    `BF16_DENSE_TOL`. MoE models: this router and combine run in fp32 where transformers'
    run in bf16, and near-tie tokens pick other experts on either side, so the two bf16 runs
    are compared through their distance to the fp32 reference instead: ours is no further."""
    from transformers import AutoModelForCausalLM

    name, hf, path = checkpoint
    ids = _ids()
    ours = load_hf(path, dtype=torch.bfloat16).eval()
    ref_bf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        ref = _logprobs(hf.float()(ids).logits, ids)
        theirs = _logprobs(ref_bf16(ids).logits, ids)
        got = _logprobs(ours(ids).logits, ids)
    to_theirs = float((got - theirs).abs().max())
    ours_err, their_err = (got - ref).abs(), (theirs - ref).abs()
    print(
        f"{name} bf16 max|dlogprob| vs transformers bf16 = {to_theirs:.2e}; vs fp32: "
        f"ours max {float(ours_err.max()):.2e} mean {float(ours_err.mean()):.2e}, "
        f"transformers max {float(their_err.max()):.2e} mean {float(their_err.mean()):.2e}"
    )
    if not MOE_LAYERS[name]:
        assert to_theirs <= BF16_DENSE_TOL, (name, to_theirs)
    assert float(ours_err.mean()) <= 2 * float(their_err.mean()), name
    assert float(ours_err.max()) <= BF16_MAX_TOL, name


def test_routes_cover_moe_layers_only_and_replay_reproduces(checkpoint) -> None:
    name, _, path = checkpoint
    model = load_hf(path).eval()
    ids, lengths = _ids(), torch.tensor([20, 13, 7])
    with torch.no_grad(), batch_invariant():
        first = model(ids, lengths)
        assert first.route_ids.shape == (40, len(MOE_LAYERS[name]), 2 if MOE_LAYERS[name] else 0)
        again = model(ids, lengths, routing=RouterReplay(first.traces(), "R3"))
        alone = model(ids[1:2], lengths[1:2])
    assert torch.equal(again.logits, first.logits)
    assert torch.equal(again.route_ids, first.route_ids)
    # batch-invariant through the dense layers too: a row alone gives the same bits
    assert torch.equal(alone.logits[0, :13], first.logits[1, :13])


def test_save_hf_roundtrip_loads_in_transformers(checkpoint, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    name, hf, path = checkpoint
    ours = load_hf(path).eval()
    save_hf(ours, tmp_path, max_shard_bytes=30_000)
    assert (tmp_path / "model.safetensors.index.json").exists()
    back = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(back) is type(hf)
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(back(ids).logits, hf(ids).logits), name
    again = load_hf(tmp_path)
    assert again.config == ours.config
    for (k, a), (_, b) in zip(ours.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    # a second, unsharded save replaces the shards rather than mixing with them
    save_hf(ours, tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["model.safetensors"]
    assert not (tmp_path / "model.safetensors.index.json").exists()


def test_model_built_here_with_dense_layers_saves_for_transformers(tmp_path: Path) -> None:
    from transformers import Qwen3MoeForCausalLM

    cfg = MoEConfig(
        **COMMON,
        moe_intermediate_size=24,
        num_experts=4,
        num_experts_per_tok=2,
        mlp_only_layers=[0],
        kv_split_size=8,
    )
    model = MoETransformer(cfg)
    model.reset_parameters(seed=2)
    save_hf(model.eval(), tmp_path)
    hf = Qwen3MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = _ids()
    with torch.no_grad():
        diff = (_logprobs(model(ids).logits, ids) - _logprobs(hf(ids).logits, ids)).abs().max()
    assert float(diff) <= FP32_TOL
    assert load_hf(tmp_path).config == cfg


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2'"),
        ({"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "'yarn'"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "'linear'"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}, "partial"),
        ({"model_type": "mistral", "sliding_window": 4096}, "sliding_window 4096"),
        ({"model_type": "mixtral", "sliding_window": 4096}, "sliding_window 4096"),
        ({"model_type": "qwen2", "attention_bias": True}, "attention_bias"),
        ({"model_type": "deepseek_v3", "scoring_func": "softmax"}, "scoring_func"),
        ({"model_type": "deepseek_v3", "moe_layer_freq": 2}, "moe_layer_freq"),
        ({"model_type": "deepseek_v3", "rope_scaling": {"type": "yarn"}}, "'yarn'"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mlp_only_layers": [7]}, "mlp_only_layers"),
    ],
)
def test_unsupported_options_get_one_line_listing_support(
    tmp_path: Path, change: dict[str, Any], named: str
) -> None:
    import json

    from tandem.moe_determinism.model.hf_config import to_hf_config

    cfg = MoEConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, head_dim=8)
    (tmp_path / "config.json").write_text(
        json.dumps({**to_hf_config(cfg, torch.float32), **change})
    )
    with pytest.raises(MoEDeterminismError) as err:
        load_hf(tmp_path)
    msg = str(err.value)
    assert named in msg and "\n" not in msg
    if "mlp_only_layers" not in change:
        assert "supported: model_type qwen3_moe, qwen3, llama, mistral, qwen2, mixtral" in msg


def test_missing_shard_and_missing_tensor_are_named(checkpoint, tmp_path: Path) -> None:
    _, _, path = checkpoint
    copy = save_hf(load_hf(path), tmp_path / "ckpt", max_shard_bytes=30_000)
    victim = sorted(copy.glob("model-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(MoEDeterminismError, match=victim.name):
        load_hf(copy)
    (copy / "model.safetensors.index.json").unlink()
    with pytest.raises(MoEDeterminismError, match="missing tensors"):
        load_hf(copy)
