"""Batch-invariant matrix multiplication on CPU.

BLAS libraries pick a kernel (and with it the order in which each output element's
products are summed) from the problem *shape*: MKL's sgemm gives different bits for row i
of `A[:m] @ B` and of `A @ B` for small m. For a *fixed* shape the kernel and its order are
fixed, and a row's result does not depend on the values or position of the other rows.
So every product here is cut into row blocks of exactly `row_block(dtype)` rows (the last
block zero-padded) and each block is one fixed-shape GEMM. This is the CPU analogue of
"one tile configuration per dtype, no split-K" on the GPU.

The blocks are computed with the `out=` overloads of torch's GEMMs, which are separate
operators from the ones `batch_invariant()` overrides, so there is no recursion.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.moe_determinism.errors import MoEDeterminismError


def cuda_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    from tandem.moe_determinism.kernels.dispatch import cuda_mm as kernel

    return kernel(a, b)


def cuda_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    from tandem.moe_determinism.kernels.dispatch import cuda_bmm as kernel

    return kernel(a, b)


ROW_BLOCK = {torch.float32: 16, torch.float64: 16, torch.bfloat16: 16, torch.float16: 16}
"""Rows per fixed-shape GEMM. Small enough that a padded decode batch wastes little (small-M
GEMM is bound by reading the weight), large enough that training-size products run close to
BLAS speed."""


def row_block(dtype: torch.dtype) -> int:
    return ROW_BLOCK.get(dtype, 16)


def _check(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if a.shape[-1] != b.shape[-2]:
        raise MoEDeterminismError(
            f"{what}: inner dimensions differ ({tuple(a.shape)} @ {tuple(b.shape)}); "
            "the last dim of the first operand must equal the second-to-last of the second"
        )
    if a.dtype != b.dtype:
        raise MoEDeterminismError(
            f"{what}: dtypes differ ({a.dtype} vs {b.dtype}); cast one operand first"
        )


class _BlockedProduct(torch.autograd.Function):
    """Autograd for the blocked GEMMs (the `out=` kernels they use do not record a graph).

    Only the forward pass has to be invariant; gradients use torch's products."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(a, b)
        if a.is_cuda:
            return cuda_bmm(a, b) if a.dim() == 3 else cuda_mm(a, b)
        return bmm_blocks(a, b) if a.dim() == 3 else mm_blocks(a, b)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # type: ignore[override]
        a, b = ctx.saved_tensors
        ga = grad @ b.transpose(-1, -2) if ctx.needs_input_grad[0] else None
        gb = a.transpose(-1, -2) @ grad if ctx.needs_input_grad[1] else None
        return ga, gb


def _needs_graph(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)


def fixed_shape_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """One `torch.bmm` on operands whose per-matrix shape the caller keeps fixed.

    Uses the `out=` kernel (not overridden by `batch_invariant()`, so no extra padding)
    and still supports autograd."""
    if _needs_graph(a, b):
        return _FixedBmm.apply(a, b)
    out = torch.empty(a.shape[0], a.shape[1], b.shape[2], dtype=a.dtype, device=a.device)
    return torch.bmm(a, b, out=out)


class _FixedBmm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(a, b)
        out = torch.empty(a.shape[0], a.shape[1], b.shape[2], dtype=a.dtype, device=a.device)
        return torch.bmm(a, b, out=out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # type: ignore[override]
        a, b = ctx.saved_tensors
        ga = torch.bmm(grad, b.transpose(1, 2)) if ctx.needs_input_grad[0] else None
        gb = torch.bmm(a.transpose(1, 2), grad) if ctx.needs_input_grad[1] else None
        return ga, gb


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[G, M, K] @ [G, K, N] with each row's reduction order independent of M."""
    if a.dim() != 3 or b.dim() != 3:
        raise MoEDeterminismError(f"bmm expects 3-D operands, got {a.dim()}-D and {b.dim()}-D")
    _check(a, b, "bmm")
    if _needs_graph(a, b):
        return _BlockedProduct.apply(a, b)
    if a.is_cuda:
        return cuda_bmm(a, b)
    return bmm_blocks(a, b)


def bmm_blocks(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The CPU kernel of `bmm` (no autograd graph)."""
    g, m, k = a.shape
    n = b.shape[-1]
    r = row_block(a.dtype)
    blocks = -(-m // r) if m else 0
    padded = F.pad(a, (0, 0, 0, blocks * r - m)) if blocks * r != m else a
    padded = padded.reshape(g, blocks, r, k)
    # Same fixed-shape [r, K] @ [K, N] products either way; fewer, larger calls are faster.
    # Each slab is written contiguously, so every GEMM sees the same strides.
    if g <= blocks:
        out = torch.empty(g, blocks, r, n, dtype=a.dtype, device=a.device)
        for i in range(g):
            torch.bmm(padded[i], b[i].expand(blocks, k, n), out=out[i])
        return out.view(g, blocks * r, n)[:, :m]
    out = torch.empty(blocks, g, r, n, dtype=a.dtype, device=a.device)
    for i in range(blocks):
        torch.bmm(padded[:, i], b, out=out[i])
    return out.permute(1, 0, 2, 3).reshape(g, blocks * r, n)[:, :m]


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[M, K] @ [K, N], row-invariant."""
    if a.dim() != 2 or b.dim() != 2:
        raise MoEDeterminismError(f"mm expects 2-D operands, got {a.dim()}-D and {b.dim()}-D")
    _check(a, b, "mm")
    if _needs_graph(a, b):
        return _BlockedProduct.apply(a, b)
    if a.is_cuda:
        return cuda_mm(a, b)
    return mm_blocks(a, b)


def mm_blocks(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The CPU kernel of `mm` (no autograd graph).

    In fp32/fp64 all row blocks go to one `torch.bmm` against the weight broadcast along the
    batch (a stride-0 view, never copied): per block the very same [r, K] @ [K, N] product as
    one `torch.mm` per block, bit for bit, without a Python loop and a thread-pool round per
    block. Half types keep one `torch.mm` per block (their bmm takes another kernel path).
    """
    m, k = a.shape
    n = b.shape[1]
    r = row_block(a.dtype)
    blocks = -(-m // r) if m else 0
    out = torch.empty(blocks, r, n, dtype=a.dtype, device=a.device)
    if not blocks:
        return out.view(0, n)
    padded = F.pad(a, (0, 0, 0, blocks * r - m)) if blocks * r != m else a
    padded = padded.reshape(blocks, r, k)
    if a.dtype in (torch.float32, torch.float64):
        torch.bmm(padded, b.expand(blocks, k, n), out=out)
    else:
        for i in range(blocks):
            torch.mm(padded[i], b, out=out[i])
    return out.view(blocks * r, n)[:m]


def addmm(
    bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float = 1.0, alpha: float = 1.0
) -> torch.Tensor:
    """beta * bias + alpha * (a @ b); the element-wise epilogue is invariant by construction."""
    prod = mm(a, b)
    if alpha != 1:
        prod = prod * alpha
    if beta == 0:
        return prod
    return prod + (bias if beta == 1 else bias * beta)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`torch.matmul` semantics for the cases models use: [..., M, K] @ [K, N] or batched."""
    if b.dim() == 2:
        lead = a.shape[:-1]
        return mm(a.reshape(-1, a.shape[-1]), b).reshape(*lead, b.shape[-1])
    if a.dim() < 3 or b.dim() < 3:
        raise MoEDeterminismError(
            f"matmul supports [..., M, K] @ [K, N] and batched 3-D+ operands; got "
            f"{tuple(a.shape)} @ {tuple(b.shape)}"
        )
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a3 = a.expand(*batch, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
    b3 = b.expand(*batch, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
    return bmm(a3, b3).reshape(*batch, a.shape[-2], b.shape[-1])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias, row-invariant over every leading dim of x."""
    out = matmul(x, weight.t())
    return out + bias if bias is not None else out
