"""Configuration of the reference transformer (Hugging Face field names)."""

from __future__ import annotations

import msgspec

from tandem.moe_determinism.errors import MoEDeterminismError
from tandem.moe_determinism.model.families import SUPPORTED_MODEL_TYPES, Family, family

__all__ = ["SUPPORTED_MODEL_TYPES", "MoEConfig", "RopeScaling"]


class RopeScaling(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Llama 3's RoPE frequency scaling (``rope_type: llama3``), the one scaled RoPE computed:
    wavelengths longer than ``original_max_position_embeddings / low_freq_factor`` are
    divided by ``factor``, shorter than ``.../high_freq_factor`` kept, and smoothly mixed
    between."""

    rope_type: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type != "llama3":
            raise MoEDeterminismError(
                f"rope_scaling.rope_type {self.rope_type!r} is not supported; supported: "
                "llama3 (or no scaling)"
            )
        if self.factor <= 0 or self.high_freq_factor <= self.low_freq_factor:
            raise MoEDeterminismError(
                "rope_scaling: factor must be > 0 and high_freq_factor > low_freq_factor"
            )


class MoEConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Shapes of a model of one of the supported families (`families.FAMILIES`: Qwen3-MoE,
    Qwen3, Llama, Mistral, Qwen2, Mixtral, DeepSeek-V3). Field names follow the Hugging Face
    config.

    Dense families have a SwiGLU MLP of ``intermediate_size`` in every layer. In an MoE
    family, layer i is an MoE layer unless it is in ``mlp_only_layers``, or
    ``(i + 1) % decoder_sparse_step != 0``, or ``i < first_k_dense_replace`` (the rules
    transformers uses for Qwen3-MoE and DeepSeek-V3).
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
    first_k_dense_replace: int = 0
    """The first this many layers are dense (DeepSeek-V3, Kimi K2)."""
    attention_bias: bool = False
    """Biases on the q, k, v and o projections (Llama, Mistral, Qwen3's option)."""
    rope_scaling: RopeScaling | None = None
    rope_interleave: bool = False
    """RoPE rotates interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek-V3's layout)."""
    n_group: int = 1
    """Grouped routing (DeepSeek-V3): experts in this many groups; a group's score is the sum
    of its best two biased expert scores, and only the best ``topk_group`` groups compete."""
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    """Routed experts' gate weights are multiplied by this (after normalisation)."""
    q_lora_rank: int = 0
    """Multi-head latent attention (DeepSeek-V3): rank of the query's low-rank projection
    (0 = a full-rank ``q_proj``)."""
    kv_lora_rank: int = 0
    """MLA: rank of the shared key-value latent."""
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    path: str = ""
    """A Hugging Face model directory the weights come from ("" = built from these fields);
    its config.json sets the shapes (`model_dir.config_from_dir`)."""

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise MoEDeterminismError(
                f"model_type {self.model_type!r} is not supported; supported: "
                + ", ".join(SUPPORTED_MODEL_TYPES)
            )
        fam = self.family
        if self.first_k_dense_replace < 0:
            raise MoEDeterminismError("first_k_dense_replace must be >= 0")
        if self.attention_bias and not fam.has_attention_bias_option:
            raise MoEDeterminismError(
                f"attention_bias is not an option of model_type {self.model_type!r}"
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
        if (
            fam.head_dim_from_hidden
            and self.head_dim * self.num_attention_heads != self.hidden_size
        ):
            raise MoEDeterminismError(
                f"{self.model_type}: head_dim ({self.head_dim}) must be hidden_size / "
                f"num_attention_heads ({self.hidden_size} / {self.num_attention_heads}), as "
                "its loaders compute it"
            )
        self._check_mla(fam)
        if self.rope_dim % 2:
            raise MoEDeterminismError(f"the RoPE width must be even, got {self.rope_dim}")
        self._check_router(fam)

    def _check_mla(self, fam: Family) -> None:
        mla = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        if fam.attention != "mla":
            set_ = [name for name in mla if getattr(self, name)]
            if set_:
                raise MoEDeterminismError(
                    f"{', '.join(set_)}: multi-head latent attention fields, for model_type "
                    f"deepseek_v3 only (this is {self.model_type!r})"
                )
            return
        small = [name for name in mla[1:] if getattr(self, name) <= 0]
        if small or self.q_lora_rank < 0:
            raise MoEDeterminismError(
                f"deepseek_v3: {', '.join(small) or 'q_lora_rank'} must be positive "
                "(q_lora_rank may be 0: a full-rank q_proj)"
            )

    def _check_router(self, fam: Family) -> None:
        if not self.moe_layers:
            return
        if fam.router == "softmax":
            if (self.n_group, self.topk_group, self.routed_scaling_factor) != (1, 1, 1.0):
                raise MoEDeterminismError(
                    "n_group, topk_group and routed_scaling_factor are options of the grouped "
                    f"sigmoid router (deepseek_v3), not of {self.model_type!r}'s softmax router"
                )
            if fam.model_type == "mixtral" and not self.norm_topk_prob:
                raise MoEDeterminismError("mixtral always renormalises its top-k gate weights")
            if fam.model_type == "mixtral" and self.shared_expert_intermediate_size:
                raise MoEDeterminismError("mixtral has no shared expert")
            return
        e, g = self.num_experts, self.n_group
        if g < 1 or e % g or e // g < 2 or not 1 <= self.topk_group <= g:
            raise MoEDeterminismError(
                f"grouped routing: n_group ({g}) must divide num_experts ({e}) into groups of "
                f"at least 2, and topk_group ({self.topk_group}) be in [1, n_group]"
            )
        if self.num_experts_per_tok > self.topk_group * (e // g):
            raise MoEDeterminismError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts of the "
                f"{self.topk_group} groups kept ({self.topk_group * (e // g)})"
            )

    @property
    def family(self) -> Family:
        return family(self.model_type)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the MoE layers, in order; routing traces have one entry per MoE layer."""
        if not self.family.moe or self.num_experts <= 0:
            return ()
        skip = set(self.mlp_only_layers)
        return tuple(
            i
            for i in range(self.first_k_dense_replace, self.num_hidden_layers)
            if i not in skip and (i + 1) % self.decoder_sparse_step == 0
        )

    @property
    def is_mla(self) -> bool:
        return self.family.attention == "mla"

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias or self.family.qkv_bias

    @property
    def qk_head_dim(self) -> int:
        """Width of a query or key head (MLA: its position-free and rotary parts)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def rope_dim(self) -> int:
        """How many dimensions of a query or key head RoPE rotates."""
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def kv_heads(self) -> int:
        """Key/value heads the KV cache holds (MLA caches each head's expanded keys)."""
        return self.num_attention_heads if self.is_mla else self.num_key_value_heads

    @property
    def attn_head_dim(self) -> int:
        """Width of a cached key or value head: MLA pads the narrower of its key and value
        heads with zeros to the wider one, so one attention kernel serves both."""
        return max(self.qk_head_dim, self.v_head_dim) if self.is_mla else self.head_dim

    @property
    def out_head_dim(self) -> int:
        """Width of one head's attention output (the value head)."""
        return self.v_head_dim if self.is_mla else self.head_dim

    @property
    def dense_intermediate_size(self) -> int:
        return self.intermediate_size or self.moe_intermediate_size
