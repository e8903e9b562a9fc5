"""Attention of the reference transformer: grouped-query attention (Llama, Mistral, Qwen2,
Qwen3, Mixtral) and DeepSeek-V3's multi-head latent attention (MLA), over one core (`attend`)
that places the flat tokens' queries, keys and values into sequences, writes and reads the
KV cache, and calls the batch-invariant kernel under `batch_invariant()` (torch's SDPA
otherwise).

MLA is computed in its expanded form: the latent is projected up to every head's keys and
values, and those are what the cache holds (value heads padded with zeros to the key width,
or the reverse, so the same kernel serves it; the padding adds exact zeros). The cache then
grows with heads x head width per token rather than with the latent's rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.moe_determinism import ops
from tandem.moe_determinism.mode import is_batch_invariant
from tandem.moe_determinism.model.basics import RMSNorm, TokenLayout
from tandem.moe_determinism.model.config import MoEConfig
from tandem.moe_determinism.model.rope import Rope


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: TokenLayout,
    layer_idx: int,
    kv_split_size: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of flat tokens: q [N, H, D], k and v [N, Hkv, D] -> [N, H, D].
    ``scale`` defaults to 1/sqrt(D)."""
    _, h, d = q.shape
    hkv = k.shape[1]
    s, t = layout.num_seqs, layout.max_count
    qp = q.new_zeros(s, t, h, d)
    qp[layout.seq_of, layout.index] = q
    q_pos = torch.zeros(s, t, dtype=torch.long, device=q.device)
    q_pos[layout.seq_of, layout.index] = layout.positions
    if layout.cache is not None:
        assert layout.slots is not None
        kc, vc = layout.cache.keys[layer_idx], layout.cache.values[layer_idx]
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
        keys = q.new_zeros(s, span, hkv, d)
        values = q.new_zeros(s, span, hkv, d)
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
            kv_split_size=kv_split_size,
            q_positions=q_pos,
            kv_lengths=kv_len,
            kv_slots=kv_slots,
            kv_origins=kv_origins,
            scale=scale,
        )
    elif layout.parents is not None:
        return _stock_by_sequence(qp, keys, values, layout, kv_len, scale)
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
            scale=scale,
        )
    return out.transpose(1, 2)[layout.seq_of, layout.index]  # [N, H, D]


class Attention(nn.Module):
    """Grouped-query attention with RoPE; per-head q/k RMSNorm where the family has it
    (Qwen3), biases where the family or ``attention_bias`` puts them."""

    def __init__(self, cfg: MoEConfig, layer_idx: int) -> None:
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        h, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=cfg.attention_bias)
        if cfg.family.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, layout: TokenLayout, rope: Rope) -> torch.Tensor:
        cfg = self.cfg
        n = x.shape[0]
        h, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q = self.q_proj(x).view(n, h, d)
        k = self.k_proj(x).view(n, hkv, d)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        v = self.v_proj(x).view(n, hkv, d)
        out = attend(rope(q), rope(k), v, layout, self.layer_idx, cfg.kv_split_size)
        return self.o_proj(out.reshape(n, h * d))

    def hf_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """Checkpoint name -> tensor, for this layer's attention (``prefix`` ends in '.')."""
        return _named(self, prefix, ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"))


class MLAttention(nn.Module):
    """DeepSeek-V3's multi-head latent attention: queries through a low-rank projection (or a
    full one), keys and values from one shared latent of ``kv_lora_rank`` plus a shared
    rotary key part of ``qk_rope_head_dim``; every query head sees keys of
    ``qk_nope_head_dim + qk_rope_head_dim`` and values of ``v_head_dim``."""

    def __init__(self, cfg: MoEConfig, layer_idx: int) -> None:
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        h, d = cfg.num_attention_heads, cfg.hidden_size
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(d, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(d, h * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(
            cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(h * cfg.v_head_dim, d, bias=False)

    def forward(self, x: torch.Tensor, layout: TokenLayout, rope: Rope) -> torch.Tensor:
        cfg = self.cfg
        n, h = x.shape[0], cfg.num_attention_heads
        nope, rot, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        if cfg.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q_nope, q_rot = q.view(n, h, nope + rot).split([nope, rot], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, rot], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(n, h, nope + dv)
        k_nope, v = kv.split([nope, dv], dim=-1)
        k_rot = rope(k_rot.reshape(n, 1, rot)).expand(n, h, rot)
        q = torch.cat([q_nope, rope(q_rot)], dim=-1)
        k = torch.cat([k_nope, k_rot], dim=-1)
        width = cfg.attn_head_dim
        q, k, v = (F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))
        out = attend(
            q, k, v, layout, self.layer_idx, cfg.kv_split_size, scale=cfg.qk_head_dim**-0.5
        )
        return self.o_proj(out[..., :dv].reshape(n, h * dv))

    def hf_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        names = (
            "q_proj",
            "q_a_proj",
            "q_a_layernorm",
            "q_b_proj",
            "kv_a_proj_with_mqa",
            "kv_a_layernorm",
            "kv_b_proj",
            "o_proj",
        )
        return _named(self, prefix, names)


def _named(module: nn.Module, prefix: str, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """``prefix + name + '.weight'`` (and ``'.bias'``) for each sub-module present."""
    out: dict[str, torch.Tensor] = {}
    for name in names:
        sub = getattr(module, name, None)
        if sub is None:
            continue
        out[f"{prefix}{name}.weight"] = sub.weight
        if getattr(sub, "bias", None) is not None:
            out[f"{prefix}{name}.bias"] = sub.bias
    return out


def _stock_by_sequence(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    layout: TokenLayout,
    kv_len: torch.Tensor,
    scale: float | None,
) -> torch.Tensor:
    """A shared-prefix layout (tails reading their parent's keys) by torch's fused attention
    one sequence at a time, each on its own queries and the keys it may see: q [S, H, T, D],
    keys and values [S, Hkv, span, D] -> [N, H, D].

    One padded call over the batch computes every sequence at the longest one's size with an
    explicit mask, so the kernel skips nothing: a demo micro-batch (a 650-token prompt, eight
    265-token tails) then costs about 2.5x its real scores, in backward too. Per sequence, a
    parent (from position 0) takes the causal kernel without a mask, which skips the masked
    blocks, and each tail a mask of its own [count, keys]. (A batch of whole sequences keeps
    the one causal call: no mask, little padding when lengths are alike.)"""
    group = q.shape[1] // keys.shape[1]
    counts, offsets = layout.counts.tolist(), layout.offsets.tolist()
    pieces = []
    for i, (count, offset) in enumerate(zip(counts, offsets, strict=True)):
        span = int(kv_len[i])
        qi = q[i : i + 1, :, :count]
        ki, vi = keys[i : i + 1, :, :span], values[i : i + 1, :, :span]
        if group > 1:
            ki, vi = ki.repeat_interleave(group, 1), vi.repeat_interleave(group, 1)
        mask = None
        if offset:  # queries at offset.., keys 0..span-1: causal aligned at the bottom right
            pos = torch.arange(offset, offset + count, device=q.device)[None]
            # 2-D: torch's CPU kernel takes a [1, T, S] mask down its unfused path (other
            # bits, about 1.5x the time forward and backward), a [T, S] one fused.
            mask = ops.attention_mask(pos, kv_len[i : i + 1], span, True)[0]
        out = F.scaled_dot_product_attention(
            qi, ki, vi, attn_mask=mask, is_causal=mask is None, scale=scale
        )
        pieces.append(out[0].transpose(0, 1))  # [count, H, D]
    starts = torch.tensor([0, *counts], device=q.device).cumsum(0)
    return torch.cat(pieces)[starts[layout.seq_of] + layout.index]


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
