"""Batch-invariant reductions: sum, mean, softmax, log_softmax, RMSNorm, and SiLU/sigmoid.

Why not torch's own: a CPU reduction over the last dimension is serial per row only while
torch decides to parallelise over rows. When a tensor has few rows but many elements (one
decode step over a large vocabulary), torch splits the *reduced* dimension across threads
and adds the partial sums in a different order, so the same row gets a different result in
a batch of 1 than in a batch of 64, and a different one with 1 thread than with 2.

The fix here is a fixed reduction tree: the row is cut into chunks of `CHUNK` elements,
each chunk is reduced by one `torch.sum` over a short contiguous dimension (always serial
per output, because the output dimension is then the larger one), and the chunk sums are
reduced the same way, level by level. The order depends only on the row length, never on
the number of rows or threads. Element-wise ops are invariant except where torch mixes a
vectorised and a scalar code path (the tail of a vector loop): `sigmoid` and `silu` do, so
they are rebuilt from `exp`, whose two paths agree.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64
"""Elements per leaf of the reduction tree (and per level above it)."""


def _pad_last(x: torch.Tensor, multiple: int, value: float = 0.0) -> torch.Tensor:
    pad = (-x.shape[-1]) % multiple
    return F.pad(x, (0, pad), value=value) if pad else x


def fixed_sum(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """Sum over `dim` in an order fixed by the length of `dim` alone.

    Accumulates in the input dtype; pass fp32 for bf16 data (the callers here do).
    """
    dim = dim % x.dim() if x.dim() else 0
    if x.dim() == 0:
        return x.clone()
    moved = x.movedim(dim, -1)
    if x.is_cuda:
        from tandem.moe_determinism.kernels.dispatch import cuda_row_sum

        out = cuda_row_sum(moved).to(x.dtype)
        return out.unsqueeze(dim) if keepdim else out
    while moved.shape[-1] > CHUNK:
        moved = _pad_last(moved, CHUNK)
        moved = moved.reshape(*moved.shape[:-1], -1, CHUNK).sum(-1)
    out = moved.sum(-1)
    return out.unsqueeze(dim) if keepdim else out


def tree_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Adjacent-pair tree sum over `dim`, padded with zeros to a power of two.

    Appending zeros to the input never changes the result (x + 0 == x), which is what makes
    attention invariant to the KV length: a query's trailing, fully masked KV splits are
    all zeros, and there are more of them in prefill than in decode.
    """
    dim = dim % x.dim()
    if x.shape[dim] == 0:
        shape = list(x.shape)
        del shape[dim]
        return x.new_zeros(shape)
    # The zero padding is never materialised: an odd element out pairs with a padding zero,
    # which is `+ 0` (bit for bit what the padded tree computes, -0 turning into +0 included).
    while x.shape[dim] > 1:
        n = x.shape[dim]
        pairs = x.narrow(dim, 0, n - n % 2).unflatten(dim, (-1, 2))
        summed = pairs.select(dim + 1, 0) + pairs.select(dim + 1, 1)
        if n % 2:
            summed = torch.cat([summed, x.narrow(dim, n - 1, 1) + 0.0], dim=dim)
        x = summed
    return x.squeeze(dim)


def _accumulate_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype


def mean(
    x: torch.Tensor,
    dim: int | list[int] | tuple[int, ...] | None = None,
    keepdim: bool = False,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Mean with a fixed reduction order (fp32 accumulation for half types)."""
    out_dtype = dtype or x.dtype
    acc = x.to(dtype or _accumulate_dtype(x))
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        dims = list(range(x.dim()))
    elif isinstance(dim, int):
        dims = [dim]
    else:
        dims = list(dim)
    dims = sorted({d % max(x.dim(), 1) for d in dims})
    count = 1
    for d in dims:
        count *= x.shape[d] if x.dim() else 1
    if x.dim() == 0:
        return acc.to(out_dtype)
    # Flatten the reduced dims into one trailing dim so one fixed tree covers them all.
    keep = [d for d in range(x.dim()) if d not in dims]
    moved = acc.permute(*keep, *dims)
    moved = moved.reshape(*[x.shape[d] for d in keep], -1)
    out = fixed_sum(moved, -1) / count
    if keepdim:
        for d in dims:
            out = out.unsqueeze(d)
    return out.to(out_dtype)


def softmax(x: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Softmax whose per-row result does not depend on the other rows or on threads."""
    out_dtype = dtype or x.dtype
    acc = x.to(dtype or _accumulate_dtype(x))
    m = acc.amax(dim, keepdim=True)  # max is exact: order never matters
    shifted = acc - m
    if _no_graph(shifted):  # the same ops in one fresh buffer
        e = shifted.exp_()
        return e.div_(fixed_sum(e, dim, keepdim=True)).to(out_dtype)
    e = torch.exp(shifted)
    return (e / fixed_sum(e, dim, keepdim=True)).to(out_dtype)


def log_softmax(x: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Log-softmax with a fixed-order log-sum-exp."""
    out_dtype = dtype or x.dtype
    if x.is_cuda and dim in (-1, x.dim() - 1) and dtype in (None, x.dtype):
        from tandem.moe_determinism.kernels.dispatch import cuda_log_softmax

        return cuda_log_softmax(x)
    acc = x.to(dtype or _accumulate_dtype(x))
    m = acc.amax(dim, keepdim=True)
    shifted = acc - m
    lse = torch.log(fixed_sum(torch.exp(shifted), dim, keepdim=True))
    if _no_graph(shifted):  # the same ops, shifted's buffer reused for the result
        return shifted.sub_(lse).to(out_dtype)
    return (shifted - lse).to(out_dtype)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6
) -> torch.Tensor:
    """RMSNorm over the last dim, computed in fp32 (Qwen3 convention), cast back at the end."""
    if x.is_cuda:
        from tandem.moe_determinism.kernels.dispatch import cuda_rms_norm

        return cuda_rms_norm(x, weight, eps)
    acc = x.to(_accumulate_dtype(x))
    variance = fixed_sum(acc * acc, -1, keepdim=True) / acc.shape[-1]
    y = acc * torch.rsqrt(variance + eps)
    if weight is not None:
        return weight * y.to(x.dtype)
    return y.to(x.dtype)


def _no_graph(t: torch.Tensor) -> bool:
    """True when autograd records nothing through ``t``, a fresh intermediate: it may then be
    overwritten in place (no backward formula kept it). So it is under `batch_invariant()`,
    whose kernels run beneath autograd, and under `torch.no_grad()`. In-place and
    out-of-place element-wise ops give the same bits: one fresh buffer fewer per op is all
    that changes (a page-faulted allocation as large as the activations)."""
    return not t.requires_grad


def _one_plus_exp_neg(x: torch.Tensor) -> torch.Tensor:
    """1 + exp(-x), in a single fresh buffer when no graph is recorded."""
    t = torch.neg(x)
    return t.exp_().add_(1.0) if _no_graph(t) else 1.0 + torch.exp(t)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """Sigmoid from `exp`, whose vector and scalar code paths agree (torch's sigmoid's don't)."""
    t = _one_plus_exp_neg(x)
    return t.reciprocal_() if _no_graph(t) else 1.0 / t


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU = x * sigmoid(x), written as x / (1 + exp(-x)) for the same reason as `sigmoid`."""
    t = _one_plus_exp_neg(x)
    return torch.div(x, t, out=t) if _no_graph(t) else x / t
