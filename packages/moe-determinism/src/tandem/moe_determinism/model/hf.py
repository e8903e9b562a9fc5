"""Save/load in the Hugging Face Qwen3-MoE layout (config.json + model.safetensors).

The tensor names are those of Qwen3-MoE checkpoints on the Hub (one tensor per expert
projection), which transformers and vLLM load directly. A shared expert, which Qwen3-MoE
does not have, is written as `mlp.shared_expert.{gate,up,down}_proj` and flagged in the
config with `shared_expert_intermediate_size`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tandem.moe_determinism.errors import MoEDeterminismError
from tandem.moe_determinism.model.config import MoEConfig
from tandem.moe_determinism.model.transformer import MoETransformer

_CONFIG_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "moe_intermediate_size",
    "num_experts",
    "num_experts_per_tok",
    "norm_topk_prob",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
    "initializer_range",
)


def hf_config(cfg: MoEConfig, dtype: torch.dtype) -> dict:
    out = {k: getattr(cfg, k) for k in _CONFIG_KEYS}
    out.update(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        hidden_act="silu",
        intermediate_size=cfg.moe_intermediate_size,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        attention_bias=False,
        attention_dropout=0.0,
        rope_theta=cfg.rope_theta,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        output_router_logits=False,
        router_aux_loss_coef=0.0,
        use_cache=True,
        torch_dtype=str(dtype).removeprefix("torch."),
        tandem_kv_split_size=cfg.kv_split_size,
    )
    if cfg.shared_expert_intermediate_size:
        out["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
    return out


def hf_state_dict(model: MoETransformer) -> dict[str, torch.Tensor]:
    cfg = model.config
    sd: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": model.embed_tokens.weight,
        "model.norm.weight": model.norm.weight,
    }
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = model.lm_head.weight
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = layer.input_layernorm.weight
        sd[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[p + f"self_attn.{name}.weight"] = getattr(layer.self_attn, name).weight
        sd[p + "self_attn.q_norm.weight"] = layer.self_attn.q_norm.weight
        sd[p + "self_attn.k_norm.weight"] = layer.self_attn.k_norm.weight
        mlp = layer.mlp
        sd[p + "mlp.gate.weight"] = mlp.gate.weight
        for e in range(cfg.num_experts):
            for name in ("gate_proj", "up_proj", "down_proj"):
                sd[p + f"mlp.experts.{e}.{name}.weight"] = getattr(mlp, name)[e]
        if mlp.shared_expert is not None:
            for name in ("gate_proj", "up_proj", "down_proj"):
                sd[p + f"mlp.shared_expert.{name}.weight"] = getattr(mlp.shared_expert, name).weight
    return {k: v.detach().contiguous().clone() for k, v in sd.items()}


def save_hf(model: MoETransformer, directory: str | Path) -> Path:
    """Write config.json and model.safetensors; returns the directory."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    dtype = next(model.parameters()).dtype
    (path / "config.json").write_text(json.dumps(hf_config(model.config, dtype), indent=2))
    save_file(hf_state_dict(model), str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def load_hf(directory: str | Path, dtype: torch.dtype | None = None) -> MoETransformer:
    """Build a `MoETransformer` from a Qwen3-MoE directory (config.json + *.safetensors)."""
    path = Path(directory)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise MoEDeterminismError(f"{cfg_file} not found: not a Hugging Face model directory")
    raw = json.loads(cfg_file.read_text())
    if raw.get("model_type") != "qwen3_moe":
        raise MoEDeterminismError(
            f"{cfg_file}: model_type is {raw.get('model_type')!r}, expected 'qwen3_moe'"
        )
    if raw.get("mlp_only_layers") or raw.get("decoder_sparse_step", 1) != 1:
        raise MoEDeterminismError(
            "dense (mlp_only) layers are not supported: every layer must be MoE"
        )
    theta = raw.get("rope_theta") or (raw.get("rope_parameters") or {}).get(
        "rope_theta", 1_000_000.0
    )
    cfg = MoEConfig(
        **{k: raw[k] for k in _CONFIG_KEYS if k in raw},
        rope_theta=float(theta),
        shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size", 0)),
        kv_split_size=int(raw.get("tandem_kv_split_size", 64)),
    )
    tensors: dict[str, torch.Tensor] = {}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise MoEDeterminismError(f"no *.safetensors files in {path}")
    for f in files:
        tensors.update(load_file(str(f)))
    model = MoETransformer(cfg)
    expected = hf_state_dict(model)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise MoEDeterminismError(
            f"{path}: missing tensors, e.g. {missing[:3]} ({len(missing)} in all)"
        )
    target_dtype = dtype or tensors["model.embed_tokens.weight"].dtype
    model.to(target_dtype)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(tensors["model.embed_tokens.weight"])
        model.norm.weight.copy_(tensors["model.norm.weight"])
        if not cfg.tie_word_embeddings:
            model.lm_head.weight.copy_(tensors["lm_head.weight"])
        for i, layer in enumerate(model.layers):
            p = f"model.layers.{i}."
            layer.input_layernorm.weight.copy_(tensors[p + "input_layernorm.weight"])
            layer.post_attention_layernorm.weight.copy_(
                tensors[p + "post_attention_layernorm.weight"]
            )
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(layer.self_attn, name).weight.copy_(tensors[p + f"self_attn.{name}.weight"])
            layer.self_attn.q_norm.weight.copy_(tensors[p + "self_attn.q_norm.weight"])
            layer.self_attn.k_norm.weight.copy_(tensors[p + "self_attn.k_norm.weight"])
            mlp = layer.mlp
            mlp.gate.weight.copy_(tensors[p + "mlp.gate.weight"])
            for name in ("gate_proj", "up_proj", "down_proj"):
                stacked = torch.stack(
                    [tensors[p + f"mlp.experts.{e}.{name}.weight"] for e in range(cfg.num_experts)]
                )
                getattr(mlp, name).copy_(stacked)
            if mlp.shared_expert is not None:
                for name in ("gate_proj", "up_proj", "down_proj"):
                    getattr(mlp.shared_expert, name).weight.copy_(
                        tensors[p + f"mlp.shared_expert.{name}.weight"]
                    )
    return model
