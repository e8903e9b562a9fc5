"""Gradients through batch-invariant attention.

`tandem.moe_determinism`'s invariant attention computes its fixed-shape blocks with
``torch.bmm(..., out=...)``, which autograd refuses, so a model cannot be trained inside
`batch_invariant()` as it is. The trainer must be: its forward values are what has to equal
the engine's bit for bit. This wraps the op in an autograd function whose forward *is* the
invariant kernel (same bits) and whose backward recomputes plain masked attention and its
gradients in closed form (gradients need no invariance; only the forward values are
compared), through `baddbmm`, which the invariant mode leaves alone, so it runs at BLAS speed.

`enable_invariant_attention_grad` swaps the wrapper in for the op (idempotent). The forward
result is unchanged for every caller; only autograd support is added.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

_lock = threading.Lock()


class _InvariantAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        kv_lengths: torch.Tensor,
        causal: bool,
        kv_split_size: int,
        scale: float | None,
        kernel: Any,
    ) -> torch.Tensor:
        ctx.save_for_backward(q, k, v, positions, kv_lengths)
        ctx.causal, ctx.scale = causal, scale
        return kernel(
            q,
            k,
            v,
            causal=causal,
            kv_split_size=kv_split_size,
            q_positions=positions,
            kv_lengths=kv_lengths,
            scale=scale,
        )

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        q, k, v, positions, kv_lengths = ctx.saved_tensors
        gq, gk, gv = attention_backward(
            q, k, v, grad_out, positions, kv_lengths, ctx.causal, ctx.scale
        )
        return gq, gk, gv, None, None, None, None, None, None


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b through `baddbmm` (beta=0), which `batch_invariant()` leaves at BLAS speed."""
    return torch.baddbmm(a.new_zeros(1, 1, 1), a, b, beta=0.0)


def attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    positions: torch.Tensor,
    kv_lengths: torch.Tensor,
    causal: bool,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of masked softmax attention, written out (no autograd, no invariant ops).

    With S = scale * Q K^T (masked), P = softmax(S), O = P V:
    dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dP * P)), dQ = scale * dS K,
    dK = scale * dS^T Q; grouped-query heads sum their K/V gradients.
    """
    from tandem.moe_determinism.ops.split_attention import attention_mask

    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    group = hq // hkv
    scale = scale if scale is not None else d**-0.5
    qf = q.float().reshape(b * hq, tq, d)
    kf = k.float().repeat_interleave(group, 1).reshape(b * hq, tk, d)
    vf = v.float().repeat_interleave(group, 1).reshape(b * hq, tk, v.shape[-1])
    go = grad_out.float().reshape(b * hq, tq, -1)
    visible = attention_mask(positions, kv_lengths, tk, causal)[:, None]  # [b, 1, tq, tk]
    scores = (_bmm(qf, kf.transpose(1, 2)) * scale).view(b, hq, tq, tk)
    scores = scores.masked_fill(~visible, float("-inf"))
    peak = scores.amax(-1, keepdim=True).clamp_min(-1e30)
    p = torch.exp(scores - peak)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-30)
    p = p.view(b * hq, tq, tk)
    gv = _bmm(p.transpose(1, 2), go)
    dp = _bmm(go, vf.transpose(1, 2))
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    gq = _bmm(ds, kf) * scale
    gk = _bmm(ds.transpose(1, 2), qf) * scale
    gk = gk.view(b, hkv, group, tk, d).sum(2)
    gv = gv.view(b, hkv, group, tk, -1).sum(2)
    return gq.view(b, hq, tq, d).to(q.dtype), gk.to(k.dtype), gv.to(v.dtype)


def enable_invariant_attention_grad() -> None:
    """Make `tandem.moe_determinism.ops.attention` differentiable (forward bits unchanged)."""
    from tandem.moe_determinism import ops
    from tandem.moe_determinism.ops import split_attention

    with _lock:
        if getattr(ops.attention, "_differentiable", False):
            return
        kernel = ops.attention

        def attention(
            q: torch.Tensor,
            k: torch.Tensor,
            v: torch.Tensor,
            *,
            causal: bool = True,
            kv_split_size: int = split_attention.KV_SPLIT_SIZE,
            q_positions: torch.Tensor | None = None,
            kv_lengths: torch.Tensor | None = None,
            scale: float | None = None,
        ) -> torch.Tensor:
            needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
            if not needs_grad or q.is_cuda:
                return kernel(
                    q,
                    k,
                    v,
                    causal=causal,
                    kv_split_size=kv_split_size,
                    q_positions=q_positions,
                    kv_lengths=kv_lengths,
                    scale=scale,
                )
            positions, lengths = split_attention._default_positions(q, k, q_positions, kv_lengths)
            return _InvariantAttention.apply(
                q, k, v, positions, lengths, causal, kv_split_size, scale, kernel
            )

        attention._differentiable = True  # type: ignore[attr-defined]
        ops.attention = attention
