"""Layers of the reference transformer: the MoE block (softmax top-k or grouped sigmoid
router over SwiGLU experts, an optional shared expert) and the decoder layer.

Matmuls go through `F.linear`, so `batch_invariant()` makes them invariant.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.moe_determinism.model.attention import Attention, MLAttention
from tandem.moe_determinism.model.basics import (
    RMSNorm,
    SwiGLU,
    TokenLayout,
    invariant_cpu_scope,
)
from tandem.moe_determinism.model.config import MoEConfig
from tandem.moe_determinism.model.experts import routed_experts
from tandem.moe_determinism.model.rope import Rope
from tandem.moe_determinism.routing import combine, route

__all__ = ["DecoderLayer", "MoEBlock", "RMSNorm", "SwiGLU", "TokenLayout", "invariant_cpu_scope"]


class MoEBlock(nn.Module):
    """A router (softmax top-k, or DeepSeek-V3's grouped sigmoid with a per-expert correction
    bias, `routing.route`) over SwiGLU experts, plus an optional always-on shared expert.

    Expert weights are stacked [E, out, in]; `experts.routed_experts` multiplies each
    expert's weights by the rows routed to it alone (each row's result does not depend on
    which other rows were routed there, under `batch_invariant()`).
    """

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = nn.Linear(d, e, bias=False)  # the router
        if cfg.family.router == "grouped_sigmoid":
            # selection-only bias, set by the load balancer of pre-training, not by gradients
            self.gate.register_buffer("e_score_correction_bias", torch.zeros(e))
        self.gate_proj = nn.Parameter(torch.empty(e, f, d))
        self.up_proj = nn.Parameter(torch.empty(e, f, d))
        self.down_proj = nn.Parameter(torch.empty(e, d, f))
        self.shared_expert = (
            SwiGLU(d, cfg.shared_expert_intermediate_size)
            if cfg.shared_expert_intermediate_size
            else None
        )

    def forward(
        self, x: torch.Tensor, replay_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (output [N, hidden], expert ids used [N, top_k])."""
        cfg = self.cfg
        logits = F.linear(x.float(), self.gate.weight.float())  # fp32 router
        r = route(
            logits,
            cfg.num_experts_per_tok,
            cfg.norm_topk_prob,
            replay_ids,
            kind=cfg.family.router,
            bias=getattr(self.gate, "e_score_correction_bias", None),
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            scale=cfg.routed_scaling_factor,
        )
        slots = routed_experts(x, r.ids, self.gate_proj, self.up_proj, self.down_proj)
        out = combine(slots, r.weights)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x).float()
        return out.to(x.dtype), r.ids


class DecoderLayer(nn.Module):
    """Attention then an MoE block, or a dense SwiGLU MLP where the config says the layer is
    dense (`MoEConfig.moe_layers`); a dense layer returns no routes."""

    def __init__(self, cfg: MoEConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg, layer_idx) if cfg.is_mla else Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: MoEBlock | SwiGLU = (
            MoEBlock(cfg)
            if layer_idx in cfg.moe_layers
            else SwiGLU(cfg.hidden_size, cfg.dense_intermediate_size)
        )

    def forward(
        self,
        x: torch.Tensor,
        layout: TokenLayout,
        rope: Rope,
        replay_ids: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        with invariant_cpu_scope(x):  # also for an activation-checkpoint recompute
            x = x + self.self_attn(self.input_layernorm(x), layout, rope)
            if isinstance(self.mlp, SwiGLU):
                return x + self.mlp(self.post_attention_layernorm(x)), None
            moe_out, ids = self.mlp(self.post_attention_layernorm(x), replay_ids)
            return x + moe_out, ids
