"""What differs between the model families the reference transformer computes, in one table.

Every layer reads its family's row (`family`) instead of branching on ``model_type``: which
attention (grouped-query, or DeepSeek's multi-head latent attention), whether q and k are
RMS-normalised per head, whether q/k/v always carry biases, which router, and the tensor
names a Hugging Face checkpoint of that family uses. Plain data, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

AttentionKind = Literal["gqa", "mla"]
RouterKind = Literal["softmax", "grouped_sigmoid"]


@dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str
    """The ``architectures`` entry of its config.json (what transformers and vLLM build)."""
    moe: bool
    attention: AttentionKind = "gqa"
    qk_norm: bool = False
    """Per-head RMSNorm of q and k before RoPE (Qwen3)."""
    qkv_bias: bool = False
    """q/k/v projections always carry a bias (Qwen2), whatever ``attention_bias`` says."""
    has_attention_bias_option: bool = True
    """config.json's ``attention_bias`` puts biases on q, k, v and o (Llama, Mistral, Qwen3)."""
    router: RouterKind = "softmax"
    moe_module: str = "mlp"
    """Name of the MoE block inside a layer (Mixtral: ``block_sparse_moe``)."""
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    """Checkpoint names of an expert's gate, up and down projections (Mixtral: w1, w3, w2)."""
    shared_expert_module: str = "shared_expert"
    """Name of the always-on expert inside the MoE block (DeepSeek: ``shared_experts``)."""
    shared_expert_gated: bool = True
    """Whether serving stacks multiply that expert by a sigmoid gate (Qwen2-MoE's layout,
    which vLLM's Qwen3-MoE follows); tandem then writes a zero gate (see `hf`)."""
    head_dim_from_hidden: bool = False
    """Loaders compute the head width as hidden_size / num_attention_heads (vLLM's Qwen2),
    so another ``head_dim`` would be served as a different model."""
    experts_key: str = "num_experts"
    """config.json's name for the number of routed experts."""


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("qwen3_moe", "Qwen3MoeForCausalLM", moe=True, qk_norm=True),
        Family("qwen3", "Qwen3ForCausalLM", moe=False, qk_norm=True),
        Family("llama", "LlamaForCausalLM", moe=False),
        Family("mistral", "MistralForCausalLM", moe=False),
        Family(
            "qwen2",
            "Qwen2ForCausalLM",
            moe=False,
            qkv_bias=True,
            has_attention_bias_option=False,
            head_dim_from_hidden=True,
        ),
        Family(
            "mixtral",
            "MixtralForCausalLM",
            moe=True,
            has_attention_bias_option=False,
            moe_module="block_sparse_moe",
            expert_names=("w1", "w3", "w2"),
            experts_key="num_local_experts",
        ),
        Family(
            "deepseek_v3",
            "DeepseekV3ForCausalLM",
            moe=True,
            attention="mla",
            has_attention_bias_option=False,
            router="grouped_sigmoid",
            shared_expert_module="shared_experts",
            shared_expert_gated=False,
            experts_key="n_routed_experts",
        ),
    )
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
"""Where a config.json may hold its number of routed experts (transformers writes some
families' under another name than the Hub's)."""


def family(model_type: str) -> Family:
    """The family row of ``model_type`` (the config has already checked it is supported)."""
    return FAMILIES[model_type]
