"""Configuration of the reference transformer (Hugging Face Qwen3-MoE / Qwen3 field names)."""

from __future__ import annotations

import msgspec

from tandem.moe_determinism.errors import MoEDeterminismError

SUPPORTED_MODEL_TYPES = ("qwen3_moe", "qwen3")


class MoEConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Shapes of a Qwen3-MoE or dense Qwen3 model. Field names follow the Hugging Face config.

    ``model_type = "qwen3"`` is the dense model (every layer a SwiGLU MLP of
    ``intermediate_size``); ``"qwen3_moe"`` makes layer i an MoE layer unless it is in
    ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``, the rule transformers uses.
    """

    vocab_size: int = 4096
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 32
    moe_intermediate_size: int = 256
    num_experts: int = 8
    num_experts_per_tok: int = 2
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    """0 = no shared expert (Qwen3-MoE); >0 adds an always-on SwiGLU expert (Kimi/DeepSeek)."""
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    kv_split_size: int = 64
    """Keys per split in batch-invariant attention (fixed size, never a fixed count)."""
    model_type: str = "qwen3_moe"
    intermediate_size: int = 0
    """Width of the dense MLP layers; 0 = ``moe_intermediate_size``."""
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = []
    path: str = ""
    """A Hugging Face model directory the weights come from ("" = built from these fields);
    its config.json sets the shapes (`model_dir.config_from_dir`)."""

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise MoEDeterminismError(
                f"model_type {self.model_type!r} is not supported; supported: "
                + ", ".join(SUPPORTED_MODEL_TYPES)
            )
        if self.decoder_sparse_step < 1:
            raise MoEDeterminismError(
                f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}"
            )
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise MoEDeterminismError(
                f"mlp_only_layers {bad} are not layer indices in [0, {self.num_hidden_layers})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise MoEDeterminismError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.moe_layers and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise MoEDeterminismError(
                f"num_experts_per_tok must be in [1, num_experts={self.num_experts}]"
            )
        if self.head_dim % 2:
            raise MoEDeterminismError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the MoE layers, in order; routing traces have one entry per MoE layer."""
        if self.model_type != "qwen3_moe" or self.num_experts <= 0:
            return ()
        skip = set(self.mlp_only_layers)
        return tuple(
            i
            for i in range(self.num_hidden_layers)
            if i not in skip and (i + 1) % self.decoder_sparse_step == 0
        )

    @property
    def dense_intermediate_size(self) -> int:
        return self.intermediate_size or self.moe_intermediate_size
