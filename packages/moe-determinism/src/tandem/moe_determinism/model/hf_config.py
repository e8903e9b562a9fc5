"""`MoEConfig` to and from a Hugging Face ``config.json``, for every family in `families`.

Reading refuses what the reference model does not compute (sliding-window attention, RoPE
kinds other than the plain one and Llama 3's, partial rotary, other activations, MLP
biases, quantized weights) with one line that names the option and what is supported,
rather than loading a model that would silently differ from the checkpoint. Plain data, no
torch: a run config can check a model directory at start.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tandem.moe_determinism.errors import MoEDeterminismError
from tandem.moe_determinism.model.config import SUPPORTED_MODEL_TYPES, MoEConfig, RopeScaling
from tandem.moe_determinism.model.families import EXPERT_COUNT_KEYS, FAMILIES

if TYPE_CHECKING:
    import torch

_SHARED_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
    "initializer_range",
)
_MOE_KEYS = ("num_experts_per_tok", "norm_topk_prob")
_QWEN_MOE_KEYS = ("moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers")
_DEEPSEEK_KEYS = (
    "moe_intermediate_size",
    "first_k_dense_replace",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "rope_interleave",
)
SUPPORTED = (
    f"supported: model_type {', '.join(SUPPORTED_MODEL_TYPES)} with full attention (no "
    "sliding window), default or llama3 RoPE, SiLU MLPs without bias, unquantized weights"
)


def _rope_fields(cfg: MoEConfig) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        params.update(
            rope_type=s.rope_type,
            factor=s.factor,
            low_freq_factor=s.low_freq_factor,
            high_freq_factor=s.high_freq_factor,
            original_max_position_embeddings=s.original_max_position_embeddings,
        )
    return {"rope_theta": cfg.rope_theta, "rope_parameters": params}


def to_hf_config(cfg: MoEConfig, dtype: torch.dtype | str) -> dict[str, Any]:
    """The ``config.json`` transformers and vLLM read for this model."""
    fam = cfg.family
    out: dict[str, Any] = {k: getattr(cfg, k) for k in _SHARED_KEYS}
    out.update(
        architectures=[fam.architecture],
        model_type=cfg.model_type,
        hidden_act="silu",
        intermediate_size=cfg.dense_intermediate_size,
        attention_dropout=0.0,
        use_sliding_window=False,
        sliding_window=None,
        use_cache=True,
        torch_dtype=str(dtype).removeprefix("torch."),
        tandem_kv_split_size=cfg.kv_split_size,
        **_rope_fields(cfg),
    )
    if fam.has_attention_bias_option or fam.attention == "mla":
        out["attention_bias"] = cfg.attention_bias
    if fam.moe:
        out.update({k: getattr(cfg, k) for k in _MOE_KEYS})
        out[fam.experts_key] = cfg.num_experts
        out.update(output_router_logits=False, router_aux_loss_coef=0.0)
    if fam.model_type == "qwen3_moe":
        mlp_only = sorted(set(cfg.mlp_only_layers) | set(range(cfg.first_k_dense_replace)))
        out.update({k: getattr(cfg, k) for k in _QWEN_MOE_KEYS}, mlp_only_layers=mlp_only)
        if cfg.shared_expert_intermediate_size:
            out["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
    if fam.model_type == "mixtral":
        out["intermediate_size"] = cfg.moe_intermediate_size
    if fam.model_type == "deepseek_v3":
        out.update({k: getattr(cfg, k) for k in _DEEPSEEK_KEYS})
        shared, rest = divmod(cfg.shared_expert_intermediate_size, cfg.moe_intermediate_size)
        if rest:
            raise MoEDeterminismError(
                "deepseek_v3: shared_expert_intermediate_size must be a multiple of "
                "moe_intermediate_size (config.json stores n_shared_experts)"
            )
        out.update(
            n_shared_experts=shared,
            q_lora_rank=cfg.q_lora_rank or None,
            qk_head_dim=cfg.qk_head_dim,
            head_dim=cfg.qk_rope_head_dim,
            scoring_func="sigmoid",
            topk_method="noaux_tc",
            moe_layer_freq=1,
        )
    return out


def _unsupported(raw: dict[str, Any]) -> str | None:
    """The first option of ``raw`` the reference model does not implement, as a phrase."""
    kind = raw.get("model_type")
    if raw.get("hidden_act", "silu") != "silu":
        return f"hidden_act {raw['hidden_act']!r}"
    if raw.get("attention_bias") and not FAMILIES[kind].has_attention_bias_option:
        return "attention_bias true"
    if raw.get("mlp_bias"):
        return "mlp_bias true"
    if raw.get("use_sliding_window"):
        return "use_sliding_window true"
    if raw.get("sliding_window") is not None and kind in ("mistral", "mixtral"):
        return f"sliding_window {raw['sliding_window']}"
    kinds = set(raw.get("layer_types") or ()) - {"full_attention"}
    if kinds:
        return f"layer_types {sorted(kinds)}"
    for key in ("rope_scaling", "rope_parameters"):
        rope = raw.get(key) or {}
        rope_kind = rope.get("rope_type", rope.get("type", "default"))
        if rope_kind not in ("default", "llama3"):
            return f"{key} type {rope_kind!r}"
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            return f"{key} partial_rotary_factor {rope['partial_rotary_factor']}"
    if raw.get("partial_rotary_factor", 1.0) != 1.0:
        return f"partial_rotary_factor {raw['partial_rotary_factor']}"
    if kind == "deepseek_v3":
        if raw.get("scoring_func", "sigmoid") != "sigmoid":
            return f"scoring_func {raw['scoring_func']!r}"
        if raw.get("topk_method", "noaux_tc") != "noaux_tc":
            return f"topk_method {raw['topk_method']!r}"
        if raw.get("moe_layer_freq", 1) != 1:
            return f"moe_layer_freq {raw['moe_layer_freq']}"
    if raw.get("quantization_config"):
        return "quantization_config"
    return None


def _rope_scaling(raw: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(theta, llama3 scaling or None) from ``rope_parameters`` or the older ``rope_scaling``;
    a config without a theta gets transformers' default for its family."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or params
    default = 1_000_000.0 if raw.get("model_type") in ("qwen3", "qwen3_moe", "mixtral") else 1e4
    theta = raw.get("rope_theta") or params.get("rope_theta") or default
    if scaling.get("rope_type", scaling.get("type", "default")) != "llama3":
        return float(theta), None
    fields = {
        k: scaling[k]
        for k in (
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        )
        if k in scaling
    }
    fields.setdefault("original_max_position_embeddings", raw.get("max_position_embeddings", 8192))
    return float(theta), RopeScaling(**fields)


def _moe_fields(raw: dict[str, Any], kind: str) -> dict[str, Any]:
    fam = FAMILIES[kind]
    fields: dict[str, Any] = {k: raw[k] for k in _MOE_KEYS if k in raw}
    keys = (fam.experts_key, *EXPERT_COUNT_KEYS)
    fields["num_experts"] = next((raw[k] for k in keys if raw.get(k) is not None), 0)
    # transformers' default is False for Qwen3-MoE; a config that omits it means False
    fields["norm_topk_prob"] = bool(raw.get("norm_topk_prob", kind == "mixtral"))
    if kind == "qwen3_moe":
        fields.update({k: raw[k] for k in _QWEN_MOE_KEYS if k in raw})
        fields["shared_expert_intermediate_size"] = int(
            raw.get("shared_expert_intermediate_size", 0)
        )
    elif kind == "mixtral":
        fields["moe_intermediate_size"] = raw["intermediate_size"]
    else:  # deepseek_v3
        fields.update({k: raw[k] for k in _DEEPSEEK_KEYS if k in raw})
        fields["q_lora_rank"] = int(raw.get("q_lora_rank") or 0)
        fields["rope_interleave"] = bool(raw.get("rope_interleave", True))  # transformers' default
        fields["head_dim"] = int(raw.get("qk_rope_head_dim", 0))
        fields["shared_expert_intermediate_size"] = int(raw.get("n_shared_experts") or 0) * int(
            raw.get("moe_intermediate_size", 0)
        )
    return fields


def from_hf_config(raw: dict[str, Any], where: str) -> MoEConfig:
    """Read a ``config.json`` dict; ``where`` names the file in error messages."""
    kind = raw.get("model_type")
    if kind not in SUPPORTED_MODEL_TYPES:
        raise MoEDeterminismError(f"{where}: model_type {kind!r} is not supported ({SUPPORTED})")
    bad = _unsupported(raw)
    if bad:
        raise MoEDeterminismError(f"{where}: {bad} is not supported ({SUPPORTED})")
    if raw.get("head_dim") is None and "hidden_size" in raw and "num_attention_heads" in raw:
        raw = {**raw, "head_dim": raw["hidden_size"] // raw["num_attention_heads"]}
    theta, scaling = _rope_scaling(raw)
    fields: dict[str, Any] = {k: raw[k] for k in _SHARED_KEYS if k in raw}
    fields.update(
        model_type=kind,
        rope_theta=theta,
        rope_scaling=scaling,
        kv_split_size=int(raw.get("tandem_kv_split_size", 64)),
    )
    if FAMILIES[kind].has_attention_bias_option:
        fields["attention_bias"] = bool(raw.get("attention_bias", False))
    if FAMILIES[kind].moe:
        fields.update(_moe_fields(raw, kind))
    else:
        fields.update(num_experts=0, num_experts_per_tok=0)
    try:
        cfg = MoEConfig(**fields)
    except (TypeError, MoEDeterminismError) as e:
        raise MoEDeterminismError(f"{where}: {e}") from None
    # the dense width matters only where a layer is dense; keep 0 otherwise so a config
    # survives a save/load round trip unchanged
    dense = len(cfg.moe_layers) < cfg.num_hidden_layers
    if dense and "intermediate_size" in raw and kind != "mixtral":
        cfg.intermediate_size = int(raw["intermediate_size"])
    return cfg
