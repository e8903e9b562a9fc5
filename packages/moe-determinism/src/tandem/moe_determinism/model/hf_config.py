"""`MoEConfig` to and from a Hugging Face ``config.json`` (Qwen3-MoE and dense Qwen3).

Reading refuses what the reference model does not compute (sliding-window attention, scaled
RoPE, attention biases, other activations, quantized weights) with one line that names the
option and what is supported, rather than loading a model that would silently differ from
the checkpoint. Plain data, no torch: a run config can check a model directory at start.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tandem.moe_determinism.errors import MoEDeterminismError
from tandem.moe_determinism.model.config import SUPPORTED_MODEL_TYPES, MoEConfig

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
_MOE_KEYS = (
    "moe_intermediate_size",
    "num_experts",
    "num_experts_per_tok",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
)
_ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen3": "Qwen3ForCausalLM"}
SUPPORTED = (
    f"supported: model_type {' or '.join(SUPPORTED_MODEL_TYPES)} with full attention, "
    "default RoPE, no attention bias, SiLU MLPs, unquantized weights"
)


def to_hf_config(cfg: MoEConfig, dtype: torch.dtype | str) -> dict[str, Any]:
    """The ``config.json`` transformers and vLLM read for this model."""
    out: dict[str, Any] = {k: getattr(cfg, k) for k in _SHARED_KEYS}
    out.update(
        architectures=[_ARCHITECTURES[cfg.model_type]],
        model_type=cfg.model_type,
        hidden_act="silu",
        intermediate_size=cfg.dense_intermediate_size,
        attention_bias=False,
        attention_dropout=0.0,
        rope_theta=cfg.rope_theta,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        use_sliding_window=False,
        sliding_window=None,
        use_cache=True,
        torch_dtype=str(dtype).removeprefix("torch."),
        tandem_kv_split_size=cfg.kv_split_size,
    )
    if cfg.model_type == "qwen3_moe":
        out.update({k: getattr(cfg, k) for k in _MOE_KEYS})
        out.update(output_router_logits=False, router_aux_loss_coef=0.0)
        if cfg.shared_expert_intermediate_size:
            out["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
    return out


def _unsupported(raw: dict[str, Any]) -> str | None:
    """The first option of ``raw`` the reference model does not implement, as a phrase."""
    if raw.get("hidden_act", "silu") != "silu":
        return f"hidden_act {raw['hidden_act']!r}"
    if raw.get("attention_bias"):
        return "attention_bias true"
    if raw.get("use_sliding_window"):
        return "use_sliding_window true"
    kinds = set(raw.get("layer_types") or ()) - {"full_attention"}
    if kinds:
        return f"layer_types {sorted(kinds)}"
    for key in ("rope_scaling", "rope_parameters"):
        rope = raw.get(key) or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            return f"{key} type {kind!r}"
    if raw.get("quantization_config"):
        return "quantization_config"
    return None


def from_hf_config(raw: dict[str, Any], where: str) -> MoEConfig:
    """Read a ``config.json`` dict; ``where`` names the file in error messages."""
    kind = raw.get("model_type")
    if kind not in SUPPORTED_MODEL_TYPES:
        raise MoEDeterminismError(f"{where}: model_type {kind!r} is not supported ({SUPPORTED})")
    bad = _unsupported(raw)
    if bad:
        raise MoEDeterminismError(f"{where}: {bad} is not supported ({SUPPORTED})")
    if "head_dim" not in raw and "hidden_size" in raw and "num_attention_heads" in raw:
        raw = {**raw, "head_dim": raw["hidden_size"] // raw["num_attention_heads"]}
    theta = raw.get("rope_theta") or (raw.get("rope_parameters") or {}).get(
        "rope_theta", 1_000_000.0
    )
    fields: dict[str, Any] = {k: raw[k] for k in _SHARED_KEYS if k in raw}
    fields.update(
        model_type=kind,
        rope_theta=float(theta),
        kv_split_size=int(raw.get("tandem_kv_split_size", 64)),
    )
    if kind == "qwen3_moe":
        if "num_experts" not in raw and "num_local_experts" in raw:
            raw = {**raw, "num_experts": raw["num_local_experts"]}
        fields.update({k: raw[k] for k in _MOE_KEYS if k in raw})
        # transformers' default is False; a config that omits it means False, not ours (True)
        fields["norm_topk_prob"] = bool(raw.get("norm_topk_prob", False))
        fields["shared_expert_intermediate_size"] = int(
            raw.get("shared_expert_intermediate_size", 0)
        )
    else:
        fields.update(num_experts=0, num_experts_per_tok=0)
    try:
        cfg = MoEConfig(**fields)
    except (TypeError, MoEDeterminismError) as e:
        raise MoEDeterminismError(f"{where}: {e}") from None
    # the dense width matters only where a layer is dense; keep 0 otherwise so a config
    # survives a save/load round trip unchanged
    dense = len(cfg.moe_layers) < cfg.num_hidden_layers
    if dense and "intermediate_size" in raw:
        cfg.intermediate_size = int(raw["intermediate_size"])
    return cfg
