"""CUDA entry points used by the ops: Triton kernels, imported on first use."""

from __future__ import annotations

import torch

from tandem.moe_determinism.errors import MoEDeterminismError

_SUPPORTED = (torch.float32, torch.bfloat16, torch.float16)


def _kernels():
    from tandem.moe_determinism.kernels import triton_kernels

    return triton_kernels


def _check(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype not in _SUPPORTED:
            raise MoEDeterminismError(
                f"batch-invariant CUDA kernels support {_SUPPORTED}, got {t.dtype}"
            )


def cuda_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    _check(a, b)
    return _kernels().matmul(a, b)


def cuda_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    _check(a, b)
    return _kernels().matmul(a, b)


def cuda_row_sum(x: torch.Tensor) -> torch.Tensor:
    return _kernels().row_sum(x)


def cuda_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    _check(x)
    return _kernels().rms_norm(x, weight, eps)


def cuda_log_softmax(x: torch.Tensor) -> torch.Tensor:
    _check(x)
    return _kernels().log_softmax(x)


def cuda_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    kv_split_size: int,
    q_positions: torch.Tensor,
    kv_lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    _check(q, k, v)
    return _kernels().attention(q, k, v, causal, kv_split_size, q_positions, kv_lengths, scale)
