"""Gradient clipping for parameters sharded along dim 0 (FSDP), reproducible in one process.

A fully sharded trainer never holds a whole gradient, so its norm is a sum of per-shard sums
of squares; `torch.nn.utils.clip_grad_norm_` on whole tensors sums in another order and can
differ in the last bit, which changes every clipped weight. Here the norm is *defined* by
the shard layout: per parameter, the sum of squares of each dim-0 shard (`torch.chunk`, the
split FSDP uses), shards added in rank order, parameters' totals summed, then the root. An
FSDP rank computes its own shards' sums and all-reduces them (for two ranks that is one
addition, so the order does not matter); one process holding whole tensors gets the same
bits by cutting them into the same shards (``shards``), which is how the single-process
trainer stands in for a sharded one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist


def _is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "to_local") and hasattr(t, "device_mesh")


def _square_sum(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().square().sum()


def _shard_sums(grad: torch.Tensor, shards: int) -> torch.Tensor:
    """Sum of squares of ``grad`` as ``shards`` dim-0 shards add them (rank order)."""
    parts = torch.chunk(grad, shards, dim=0) if grad.dim() else (grad,)
    total = _square_sum(parts[0])
    for part in parts[1:]:
        total = total + _square_sum(part)
    return total


def sharded_grad_norm(params: Iterable[torch.nn.Parameter], shards: int = 1) -> torch.Tensor:
    """The L2 norm of the gradients of ``params`` in the shard layout (see the module doc).

    DTensor gradients (an FSDP rank) contribute their local shard and are all-reduced over
    their mesh; plain gradients are cut into ``shards`` dim-0 shards. Parameters without a
    gradient count as zero. Returns a 0-dim fp32 tensor (a plain tensor on every rank).
    """
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    sums: list[torch.Tensor] = []
    group = None
    for p in params:
        g = p.grad
        if g is None:
            sums.append(torch.zeros((), dtype=torch.float32))
        elif _is_dtensor(g):
            group = g.device_mesh.get_group()
            sums.append(_square_sum(g.to_local()))
        else:
            sums.append(_shard_sums(g, shards))
    if not sums:
        return torch.zeros((), dtype=torch.float32)
    device = sums[-1].device
    per_param = torch.stack([s.to(device) for s in sums])
    if group is not None:
        dist.all_reduce(per_param, op=dist.ReduceOp.SUM, group=group)
    return per_param.sum().sqrt()


def clip_sharded_grads(
    params: Iterable[torch.nn.Parameter], max_norm: float, shards: int = 1
) -> float:
    """Scale the gradients so their `sharded_grad_norm` is at most ``max_norm``; returns the
    norm before clipping (non-finite norms leave the gradients untouched)."""
    params = list(params)
    norm = sharded_grad_norm(params, shards)
    value = float(norm)
    if math.isfinite(value) and math.isfinite(max_norm):
        coef = float(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        if coef < 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coef)
    return value
