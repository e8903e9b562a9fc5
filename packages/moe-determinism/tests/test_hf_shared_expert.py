"""A shared expert in the Hugging Face layout: written with the zero sigmoid gate and doubled
down projection that make vLLM's gated Qwen3-MoE shared expert compute tandem's ungated one
bit for bit, read back exactly, and described by `hf_layout` as `save_hf` writes it."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tandem.moe_determinism import MoEConfig, MoEDeterminismError, MoETransformer, load_hf, save_hf
from tandem.moe_determinism.model.hf import hf_layout

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
    shared_expert_intermediate_size=40,
)
GATE = "model.layers.{}.mlp.shared_expert_gate.weight"
SHARED = "model.layers.{}.mlp.shared_expert.{}_proj.weight"


def _model(dtype: torch.dtype = torch.float32) -> MoETransformer:
    m = MoETransformer(CFG)
    m.reset_parameters(seed=3)
    return m.to(dtype).eval()


def _gated_shared_expert(ckpt: dict[str, torch.Tensor], layer: int, x: torch.Tensor):
    """vLLM's Qwen3-MoE shared expert over the checkpoint's tensors (a second implementation):
    sigmoid(gate(x)) * down(silu(gate_proj(x)) * up_proj(x))."""
    g, u, d = (ckpt[SHARED.format(layer, n)] for n in ("gate", "up", "down"))
    out = F.linear(F.silu(F.linear(x, g)) * F.linear(x, u), d)
    return torch.sigmoid(F.linear(x, ckpt[GATE.format(layer)])) * out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_gated_checkpoint_computes_the_ungated_expert_bit_for_bit(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    model = _model(dtype)
    ckpt = load_file(save_hf(model, tmp_path / "m") / "model.safetensors")
    x = torch.randn(7, CFG.hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            assert not ckpt[GATE.format(i)].any() and ckpt[GATE.format(i)].shape == (1, 64)
            want = layer.mlp.shared_expert(x)
            assert torch.equal(_gated_shared_expert(ckpt, i, x), want)
            assert torch.equal(
                ckpt[SHARED.format(i, "down")], 2 * layer.mlp.shared_expert.down_proj.weight
            )


def test_load_hf_reads_back_the_exact_weights_and_older_ungated_checkpoints(
    tmp_path: Path,
) -> None:
    model = _model()
    path = save_hf(model, tmp_path / "m", max_shard_bytes=40_000)  # the gates in other shards
    loaded = load_hf(path)
    state = model.state_dict()
    assert all(torch.equal(t, state[k]) for k, t in loaded.state_dict().items())

    # a checkpoint written before the gate: the shared expert as it is, no gate
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.json").write_text((path / "config.json").read_text())
    tensors = {k: v for f in path.glob("*.safetensors") for k, v in load_file(f).items()}
    for i in range(CFG.num_hidden_layers):
        del tensors[GATE.format(i)]
        tensors[SHARED.format(i, "down")] = tensors[SHARED.format(i, "down")] / 2
    save_file(tensors, str(old / "model.safetensors"))
    again = load_hf(old)
    assert all(torch.equal(t, state[k]) for k, t in again.state_dict().items())


def test_a_gate_other_than_the_zero_one_is_refused(tmp_path: Path) -> None:
    path = save_hf(_model(), tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    tensors[GATE.format(1)][0, 5] = 0.25
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(
        MoEDeterminismError, match=r"layers\.1\.mlp\.shared_expert_gate.*1 non-zero"
    ):
        load_hf(path)


def test_hf_layout_makes_every_tensor_save_hf_writes_from_the_state(tmp_path: Path) -> None:
    """What a weight stream's consumer (the vLLM plugin) builds from the layout and the
    model's own state is the checkpoint, tensor for tensor and bit for bit."""
    model = _model()
    ckpt = load_file(save_hf(model, tmp_path / "m") / "model.safetensors")
    state = model.state_dict()
    layout = json.loads(json.dumps(hf_layout(model)))  # as it travels
    assert layout.keys() == ckpt.keys()
    for name, (src, index, scale, zeros) in layout.items():
        if src is None:
            built = torch.zeros(zeros)
        else:
            built = (state[src] if index is None else state[src][index]) * scale
        assert torch.equal(built, ckpt[name]), name
    assert sum(scale != 1 for _, _, scale, _ in layout.values()) == CFG.num_hidden_layers
    plain = MoETransformer(msgspec.structs.replace(CFG, shared_expert_intermediate_size=0))
    assert all(v[2] == 1 and v[0] is not None for v in hf_layout(plain).values())
