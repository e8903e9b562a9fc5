"""The gradient of the CPU split attention, from torch's fused attention kernel.

Only attention's forward values must match the inference engine bit for bit; like every
product's backward under `batch_invariant()` (see `mode.py`), its gradient may come from a
stock kernel. Recording the split attention's own autograd graph kept every (query block,
KV split) pair's scores and probabilities for the backward (memory quadratic in the context:
about 0.9, 1.5 and 2.4 GB for one layer at 1k, 2k and 3k tokens) and ran its thousands of
small products backwards. Here the forward runs without a graph and saves only q, k, v, the
positions, its output and each query's log-sum-exp; the backward hands the last two to torch's
fused CPU kernel (flash attention's backward, which needs nothing else of a forward) and
takes that kernel's gradient: the exact gradient of the same function up to float rounding
(tested against float64), in memory linear in the context. Without them (a direct call of
`fused_attention_grad`) it runs the fused forward first to get them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

MASK_ELEMENTS = 1 << 24
"""Mask entries (queries x keys) per fused call when the rows need an explicit mask (a
packed or shared-prefix layout): 64 MB at a time instead of 1 GB at 16k tokens."""


class ExactForwardAttention(torch.autograd.Function):
    """``forward_fn()``'s values (the split attention, invariant bits), torch's fused
    attention's gradient. q [B, Hq, Tq, D]; k, v [B, Hkv, Tk, D]; a query at position p sees
    keys j < kv_lengths and j <= p."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_positions: torch.Tensor,
        kv_lengths: torch.Tensor,
        scale: float,
        forward_fn: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        # autograd records nothing inside a Function's forward
        out, lse = forward_fn()  # the output and each query's log-sum-exp [B, Hq, Tq]
        ctx.save_for_backward(q, k, v, q_positions, kv_lengths, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        q, k, v, q_positions, kv_lengths, out, lse = ctx.saved_tensors
        gq, gk, gv = fused_attention_grad(
            grad, q, k, v, q_positions, kv_lengths, ctx.scale, forward=(out, lse)
        )
        return gq, gk, gv, None, None, None, None


def fused_attention_grad(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    kv_lengths: torch.Tensor,
    scale: float,
    forward: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of q, k, v for causal attention with a key-length limit, by torch's fused
    CPU kernel, batch row by batch row; grouped-query heads take the sum over their query
    heads.

    ``forward``: the forward's output [B, Hq, Tq, D] and log-sum-exp [B, Hq, Tq], which is
    all the fused backward needs of a forward (its P is exp(scores - lse)); without it, the
    fused forward is run first to get them.

    A query row whose output gradient is zero (a padding row, its output dropped) has a zero
    gradient and adds exactly nothing to the keys' and values' (dO = 0 makes dV's, dP's and
    the softmax correction's terms 0), so each batch row is cut after its last query with a
    gradient, and its keys after the last one those queries see: a packed batch's short
    sequences cost their own length, not the longest one's."""
    gq, gk, gv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    group = q.shape[1] // k.shape[1]
    live = grad.ne(0).any(-1).any(1)  # [B, Tq]: query rows with a gradient
    for b in range(q.shape[0]):
        rows = live[b].nonzero()
        if rows.numel() == 0:
            continue
        tq = int(rows[-1]) + 1
        pos = q_positions[b, :tq]
        tk = min(int(kv_lengths[b]), int(pos.max()) + 1)
        if tk <= 0:
            continue
        row = None if forward is None else tuple(t[b : b + 1, :, :tq] for t in forward)
        g_q, g_k, g_v = _one_row(
            grad[b : b + 1, :, :tq], q[b : b + 1, :, :tq], k[b : b + 1, :, :tk],
            v[b : b + 1, :, :tk], pos, int(kv_lengths[b]), group, scale, row,
        )  # fmt: skip
        gq[b, :, :tq], gk[b, :, :tk], gv[b, :, :tk] = g_q[0], g_k[0], g_v[0]
    return gq, gk, gv


def _one_row(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pos: torch.Tensor,
    kv_length: int,
    group: int,
    scale: float,
    forward: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One batch row: q [1, Hq, Tq, D] at positions ``pos``, k and v [1, Hkv, Tk, D];
    ``forward`` its output and log-sum-exp, if known."""
    tq, tk = q.shape[2], k.shape[2]
    kc = k.repeat_interleave(group, 1) if group > 1 else k.contiguous()
    vc = v.repeat_interleave(group, 1) if group > 1 else v.contiguous()
    keys = torch.arange(tk, device=q.device)
    if tk == tq and bool((pos == keys).all()):
        # queries at 0..Tq-1 over as many keys: the fused causal kernel, which also skips
        # the masked blocks and needs no mask (memory linear in the context)
        gq, gk, gv = _fused(grad, q.contiguous(), kc, vc, None, True, scale, forward)
    else:  # an explicit mask, a range of queries at a time: [rows, Tk] floats each
        step = max(1, MASK_ELEMENTS // tk)
        parts = [
            _fused(
                grad[:, :, lo : lo + step],
                q[:, :, lo : lo + step].contiguous(),
                kc,
                vc,
                _mask(pos[lo : lo + step], keys, kv_length, q.dtype),
                False,
                scale,
                None if forward is None else tuple(t[:, :, lo : lo + step] for t in forward),
            )
            for lo in range(0, tq, step)
        ]
        gq = torch.cat([p[0] for p in parts], dim=2)
        gk, gv = parts[0][1], parts[0][2]
        for p in parts[1:]:  # the keys' and values' gradients add up over the query ranges
            gk, gv = gk + p[1], gv + p[2]
    if group > 1:
        hkv = k.shape[1]
        gk = gk.view(1, hkv, group, tk, k.shape[-1]).sum(2)
        gv = gv.view(1, hkv, group, tk, v.shape[-1]).sum(2)
    return gq, gk, gv


def _mask(
    pos: torch.Tensor, keys: torch.Tensor, kv_length: int, dtype: torch.dtype
) -> torch.Tensor:
    """The additive mask [1, 1, len(pos), len(keys)] of queries at ``pos``."""
    visible = (keys[None, :] <= pos[:, None]) & (keys[None, :] < kv_length)
    visible[:, 0] |= ~visible.any(-1)  # a row that sees nothing keeps key 0, as forward
    mask = torch.zeros(1, 1, pos.shape[0], keys.shape[0], dtype=dtype, device=pos.device)
    return mask.masked_fill_(~visible, float("-inf"))


def _fused(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float,
    forward: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch's fused CPU attention backward, given the forward's output and log-sum-exp or
    after its own forward to get them."""
    if forward is None:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=mask, scale=scale
        )
    else:
        out, lse = forward[0].contiguous(), forward[1].contiguous()
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad.contiguous(), q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale
    )
