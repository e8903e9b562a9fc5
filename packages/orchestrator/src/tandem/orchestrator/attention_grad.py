"""Gradients through batch-invariant attention.

`tandem.moe_determinism`'s invariant attention computes its fixed-shape blocks with
``torch.bmm(..., out=...)``, which autograd refuses, so a model cannot be trained inside
`batch_invariant()` as it is. The trainer must be: its forward values are what has to equal
the engine's bit for bit. This wraps the op in an autograd function whose forward *is* the
invariant kernel (same bits) and whose backward recomputes plain masked attention and
differentiates it (gradients need no invariance; only the forward values are compared).

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
        from tandem.moe_determinism.ops.split_attention import attention_mask

        q, k, v, positions, kv_lengths = ctx.saved_tensors
        with torch.enable_grad():
            qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
            group = q.shape[1] // k.shape[1]
            kr, vr = kg.repeat_interleave(group, 1), vg.repeat_interleave(group, 1)
            scale = ctx.scale if ctx.scale is not None else q.shape[-1] ** -0.5
            scores = torch.matmul(qg.float(), kr.float().transpose(-1, -2)) * scale
            visible = attention_mask(positions, kv_lengths, k.shape[2], ctx.causal)[:, None]
            scores = scores.masked_fill(~visible, float("-inf"))
            probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
            out = torch.matmul(probs, vr.float()).to(q.dtype)
            gq, gk, gv = torch.autograd.grad(out, (qg, kg, vg), grad_out)
        return gq, gk, gv, None, None, None, None, None, None


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
