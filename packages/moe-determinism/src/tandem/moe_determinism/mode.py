"""`batch_invariant()`: route torch's own ops to the batch-invariant ones, for a scope.

On entry, kernels for `aten::mm`, `addmm`, `bmm`, `_softmax`, `_log_softmax`, `mean.dim`,
`silu` and `sigmoid` are registered with `torch.library` for the CPU and CUDA dispatch keys;
on exit the registration is destroyed and torch's stock kernels are back. Products run by
autograd's backward formulas use the stock kernels (gradients need not match anything
bit for bit; activation-checkpoint recomputation does, and stays invariant). `F.linear`,
`torch.matmul`, `F.rms_norm` and `torch.softmax` decompose into those, so an unmodified
model becomes invariant. The overrides sit below autograd: backward formulas are torch's.

Nesting is reference-counted (only the outermost scope registers and unregisters) and
guarded by a lock, so the scope is safe to re-enter from nested code and from threads.
Nothing is registered at import time.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from tandem.moe_determinism.ops import gemm as _mm
from tandem.moe_determinism.ops import reduction as _red

_lock = threading.Lock()
_state: dict[str, object] = {"depth": 0, "library": None}
_thread = threading.local()  # `stock_kernels()` depth of the current thread


# The kernels below run beneath autograd (torch records the graph with its own formulas),
# so they call the graph-free blocked kernels directly.


def _in_backward() -> bool:
    """True while autograd runs backward formulas (not a checkpoint recompute, which runs with
    grad enabled). Only forward values must match the inference engine, so the products of
    backward use torch's stock kernels at full speed."""
    return torch._C._current_graph_task_id() != -1 and not torch.is_grad_enabled()


def _empty(x: torch.Tensor, half_to_float: bool) -> torch.Tensor:
    return torch.empty_like(x, dtype=torch.float32 if half_to_float else x.dtype)


def _stock_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = torch.empty(*a.shape[:-1], b.shape[-1], dtype=a.dtype, device=a.device)
    return torch.bmm(a, b, out=out) if a.dim() == 3 else torch.mm(a, b, out=out)


def _on_stock() -> bool:
    """True on a thread inside `stock_kernels()`."""
    return bool(getattr(_thread, "stock", 0))


def _mm_impl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    _mm._check(a, b, "mm")
    if _in_backward() or _on_stock():
        return _stock_product(a, b)
    return _mm.cuda_mm(a, b) if a.is_cuda else _mm.mm_blocks(a, b)


def _addmm_impl(
    bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float = 1, alpha: float = 1
) -> torch.Tensor:
    if _on_stock():  # torch's fused kernel, not a product and an add
        out = torch.empty(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)
        return torch.addmm(bias, a, b, beta=beta, alpha=alpha, out=out)
    prod = _mm_impl(a, b)
    if alpha != 1:
        prod = prod * alpha
    if beta == 0:
        return prod
    return prod + (bias if beta == 1 else bias * beta)


def _bmm_impl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    _mm._check(a, b, "bmm")
    if _in_backward() or _on_stock():
        return _stock_product(a, b)
    return _mm.cuda_bmm(a, b) if a.is_cuda else _mm.bmm_blocks(a, b)


def _softmax_impl(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
    if _on_stock():
        return torch.ops.aten._softmax.out(x, dim, half_to_float, out=_empty(x, half_to_float))
    return _red.softmax(x, dim, dtype=torch.float32 if half_to_float else None)


def _log_softmax_impl(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
    if _on_stock():
        out = _empty(x, half_to_float)
        return torch.ops.aten._log_softmax.out(x, dim, half_to_float, out=out)
    return _red.log_softmax(x, dim, dtype=torch.float32 if half_to_float else None)


def _mean_impl(
    x: torch.Tensor,
    dim: list[int] | None,
    keepdim: bool = False,
    *,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    if _on_stock():
        out = x.new_empty(0, dtype=dtype or x.dtype)
        return torch.ops.aten.mean.out(x, dim, keepdim, dtype=dtype, out=out)
    return _red.mean(x, dim, keepdim=keepdim, dtype=dtype)


def _silu_impl(x: torch.Tensor) -> torch.Tensor:
    if _on_stock():
        return torch.ops.aten.silu.out(x, out=torch.empty_like(x))
    return _red.silu(x)


def _sigmoid_impl(x: torch.Tensor) -> torch.Tensor:
    if _on_stock():
        return torch.ops.aten.sigmoid.out(x, out=torch.empty_like(x))
    return _red.sigmoid(x)


_OVERRIDES = {
    "mm": _mm_impl,
    "addmm": _addmm_impl,
    "bmm": _bmm_impl,
    "_softmax": _softmax_impl,
    "_log_softmax": _log_softmax_impl,
    "mean.dim": _mean_impl,
    "silu": _silu_impl,
    "sigmoid": _sigmoid_impl,
}


def _register() -> torch.library.Library:
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        # torch warns that a previously registered kernel is overridden: that is the point.
        warnings.simplefilter("ignore")
        for name, fn in _OVERRIDES.items():
            for key in ("CPU", "CUDA"):
                library.impl(name, fn, key)
    return library


def is_batch_invariant() -> bool:
    """True while a `batch_invariant()` scope is active (in any thread), but not on a thread
    inside `stock_kernels()`."""
    return bool(_state["depth"]) and not _on_stock()


@contextmanager
def stock_kernels() -> Iterator[None]:
    """On the calling thread, torch's own kernels even inside an active `batch_invariant()`
    scope, which is process-wide (the overrides are registered with torch's dispatcher): for
    work whose bits no one compares, beside threads that must stay invariant. Other threads
    keep the invariant kernels."""
    _thread.stock = getattr(_thread, "stock", 0) + 1
    try:
        yield
    finally:
        _thread.stock -= 1


@contextmanager
def batch_invariant(enabled: bool = True) -> Iterator[None]:
    """Within the scope, torch's matmul/softmax/log_softmax/mean/silu/sigmoid are invariant.

    `enabled=False` makes the scope a no-op, so callers can write
    `with batch_invariant(cfg.deterministic): ...`.
    """
    if not enabled:
        yield
        return
    with _lock:
        if _state["depth"] == 0:
            _state["library"] = _register()
        _state["depth"] = int(_state["depth"]) + 1  # type: ignore[call-overload]
    try:
        yield
    finally:
        with _lock:
            _state["depth"] = int(_state["depth"]) - 1  # type: ignore[call-overload]
            if _state["depth"] == 0:
                library = _state["library"]
                _state["library"] = None
                library._destroy()  # type: ignore[union-attr]
