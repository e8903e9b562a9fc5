"""Layers of the reference transformer: RMSNorm, RoPE, GQA attention, SwiGLU MoE or MLP.

Every layer works on a flat list of tokens [N, hidden] (the valid tokens of a padded or
packed batch, sequence after sequence); only attention needs to know which tokens belong
together, and it gets that from a `TokenLayout`. Matmuls go through `F.linear`, norms
through `mean`, activations through `F.silu`, so `batch_invariant()` makes them invariant;
attention calls the invariant kernel when that scope is active, torch's SDPA otherwise.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tandem.moe_determinism import ops
from tandem.moe_determinism.mode import is_batch_invariant
from tandem.moe_determinism.model.cache import KVCache
from tandem.moe_determinism.model.config import MoEConfig
from tandem.moe_determinism.ops.tiles import ROW_TILE
from tandem.moe_determinism.ops.workers import stock_ops_on_one_thread
from tandem.moe_determinism.routing import combine, route


def invariant_cpu_scope(x: torch.Tensor) -> AbstractContextManager[None]:
    """Around layers computing ``x`` under `batch_invariant()` on the CPU, torch's own ops run
    on the calling thread alone and the tile products get every thread
    (`stock_ops_on_one_thread`); nothing elsewhere."""
    if x.is_cuda or not is_batch_invariant():
        return nullcontext()
    return stock_ops_on_one_thread()


@dataclass
class TokenLayout:
    """Where the flat tokens of one forward pass sit.

    seq_of [N]: sequence index of each token; index [N]: its index among that sequence's new
    tokens; counts [S]: new tokens per sequence; offsets [S]: tokens already in the KV cache
    (0 without a cache); positions [N] = offsets[seq_of] + index.
    """

    seq_of: torch.Tensor
    index: torch.Tensor
    counts: torch.Tensor
    offsets: torch.Tensor
    positions: torch.Tensor
    cache: KVCache | None = None
    slots: torch.Tensor | None = None
    parents: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.counts.numel())

    @property
    def max_count(self) -> int:
        return int(self.counts.max()) if self.counts.numel() else 0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acc = x.float()
        acc = acc * torch.rsqrt(acc.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * acc.to(x.dtype)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [N, head_dim] for the rotate-half RoPE of Llama/Qwen, computed per element."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :].to(positions.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D]; cos/sin [N, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos[:, None].to(x.dtype)) + (rotated * sin[:, None].to(x.dtype))


class Attention(nn.Module):
    def __init__(self, cfg: MoEConfig, layer_idx: int) -> None:
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        h, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=False)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, layout: TokenLayout, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        cfg = self.cfg
        n = x.shape[0]
        h, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q = apply_rope(self.q_norm(self.q_proj(x).view(n, h, d)), cos, sin)
        k = apply_rope(self.k_norm(self.k_proj(x).view(n, hkv, d)), cos, sin)
        v = self.v_proj(x).view(n, hkv, d)

        s, t = layout.num_seqs, layout.max_count
        qp = x.new_zeros(s, t, h, d)
        qp[layout.seq_of, layout.index] = q
        q_pos = torch.zeros(s, t, dtype=torch.long, device=x.device)
        q_pos[layout.seq_of, layout.index] = layout.positions
        if layout.cache is not None:
            assert layout.slots is not None
            kc, vc = layout.cache.keys[self.layer_idx], layout.cache.values[self.layer_idx]
            slot_of = layout.slots[layout.seq_of]
            kc[slot_of, :, layout.positions] = k.to(kc.dtype)
            vc[slot_of, :, layout.positions] = v.to(vc.dtype)
            kv_len = layout.offsets + layout.counts
            kv_slots = kv_origins = None
            if is_batch_invariant():
                # The split kernel reads whole KV splits of the batch's slots straight from
                # the cache (keys past a row's length are masked either way): no copy; and
                # a split several rows hold (a shared prompt) once for all of them.
                keys, values, kv_slots = kc, vc, layout.slots
                kv_origins = layout.cache.origins.index_select(0, layout.slots.cpu())
            else:
                tk = int(kv_len.max())
                keys, values = kc[layout.slots, :, :tk], vc[layout.slots, :, :tk]
        else:
            kv_len, kv_slots, kv_origins = layout.offsets + layout.counts, None, None
            span = int(kv_len.max()) if s else 0
            keys = x.new_zeros(s, span, hkv, d)
            values = x.new_zeros(s, span, hkv, d)
            keys[layout.seq_of, layout.positions] = k
            values[layout.seq_of, layout.positions] = v
            if layout.parents is not None:
                keys, values = _with_parent_keys(keys, values, layout)
            keys, values = keys.transpose(1, 2), values.transpose(1, 2)
        qp = qp.transpose(1, 2)
        if is_batch_invariant():
            out = ops.attention(
                qp,
                keys,
                values,
                causal=True,
                kv_split_size=cfg.kv_split_size,
                q_positions=q_pos,
                kv_lengths=kv_len,
                kv_slots=kv_slots,
                kv_origins=kv_origins,
            )
        else:
            group = h // hkv
            if layout.cache is None and layout.parents is None:
                # Without a cache every sequence starts at position 0, so the causal mask
                # alone hides the padding keys from every real query (padded query rows are
                # dropped below); the fused causal kernel also skips the masked blocks.
                mask, causal = None, True
            else:
                mask, causal = (
                    ops.attention_mask(q_pos, kv_len, keys.shape[2], True)[:, None],
                    False,
                )
            out = F.scaled_dot_product_attention(
                qp,
                keys.repeat_interleave(group, 1),
                values.repeat_interleave(group, 1),
                attn_mask=mask,
                is_causal=causal,
            )
        out = out.transpose(1, 2)[layout.seq_of, layout.index]  # [N, H, D]
        return self.o_proj(out.reshape(n, h * d))


def _with_parent_keys(
    keys: torch.Tensor, values: torch.Tensor, layout: TokenLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """keys/values [S, L, Hkv, D] holding each sequence's own tokens at their positions; fills
    positions below each sequence's offset from its parent (a gather, so gradients flow back
    to the parent's keys and values, summed over its children)."""
    assert layout.parents is not None
    s, span = keys.shape[:2]
    pos = torch.arange(span, device=keys.device)
    src = torch.arange(s, device=keys.device)[:, None].expand(s, span)
    src = torch.where(pos[None, :] < layout.offsets[:, None], layout.parents[:, None], src)
    return keys[src, pos[None, :]], values[src, pos[None, :]]


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEBlock(nn.Module):
    """Softmax top-k router over SwiGLU experts, plus an optional shared expert.

    Expert weights are stacked [E, out, in] so per-expert GEMMs are plain `F.linear` calls
    on the rows routed to that expert (each row's result does not depend on which other
    rows were routed there, under `batch_invariant()`).
    """

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = nn.Linear(d, e, bias=False)  # the router
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
        r = route(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob, replay_ids)
        k = cfg.num_experts_per_tok
        flat = r.ids.reshape(-1)  # [N * k] expert of each (token, slot)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=cfg.num_experts)
        starts = torch.cumsum(counts, 0) - counts
        expert_of = flat[order]
        rank = torch.arange(flat.numel(), device=x.device) - starts[expert_of]
        # All experts in one batched GEMM: rows routed to expert e fill xe[e, :count_e].
        # Each row's result depends only on the row and the expert's weights, so the padding
        # and the other rows do not matter (under batch_invariant()).
        cap = int(counts.max()) if flat.numel() else 0
        if is_batch_invariant() and not x.is_cuda:  # whole row tiles: the products take the
            cap = -(-cap // ROW_TILE) * ROW_TILE  # rows where they lie instead of a padded copy
        xe = x.new_zeros(cfg.num_experts, cap, x.shape[-1])
        xe[expert_of, rank] = x[order // k]
        hidden = F.silu(torch.bmm(xe, self.gate_proj.transpose(1, 2))) * torch.bmm(
            xe, self.up_proj.transpose(1, 2)
        )
        ye = torch.bmm(hidden, self.down_proj.transpose(1, 2))
        slots_out = x.new_zeros(flat.numel(), x.shape[-1])
        slots_out[order] = ye[expert_of, rank]
        out = combine(slots_out.view(-1, k, x.shape[-1]), r.weights)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x).float()
        return out.to(x.dtype), r.ids


class DecoderLayer(nn.Module):
    """Attention then an MoE block, or a dense SwiGLU MLP where the config says the layer is
    dense (`MoEConfig.moe_layers`); a dense layer returns no routes."""

    def __init__(self, cfg: MoEConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
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
        cos: torch.Tensor,
        sin: torch.Tensor,
        replay_ids: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        with invariant_cpu_scope(x):  # also for an activation-checkpoint recompute
            x = x + self.self_attn(self.input_layernorm(x), layout, cos, sin)
            if isinstance(self.mlp, SwiGLU):
                return x + self.mlp(self.post_attention_layernorm(x)), None
            moe_out, ids = self.mlp(self.post_attention_layernorm(x), replay_ids)
            return x + moe_out, ids
