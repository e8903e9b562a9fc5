"""Batch-invariant ops: the same row (or query) gives the same bits in any batch.

On CPU these are plain-torch reference implementations with fixed-shape GEMM blocks and
fixed reduction trees; on CUDA, `mm`/`bmm`, `rms_norm`, `log_softmax` and `attention` run
Triton kernels with one fixed tile configuration and no split reductions.
"""

from tandem.moe_determinism.ops.gemm import addmm, bmm, linear, matmul, mm
from tandem.moe_determinism.ops.reduction import (
    fixed_sum,
    log_softmax,
    mean,
    rms_norm,
    sigmoid,
    silu,
    softmax,
    tree_sum,
)
from tandem.moe_determinism.ops.split_attention import KV_SPLIT_SIZE, attention, attention_mask

__all__ = [
    "KV_SPLIT_SIZE",
    "addmm",
    "attention",
    "attention_mask",
    "bmm",
    "fixed_sum",
    "linear",
    "log_softmax",
    "matmul",
    "mean",
    "mm",
    "rms_norm",
    "sigmoid",
    "silu",
    "softmax",
    "tree_sum",
]
