"""How one process's gradients meet the other ranks': FSDP's local accumulation, and the
all-reduce sum that one process emulating several ranks adds up itself (`GRPOStep.step`'s
``shards``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


@contextmanager
def fsdp_no_sync(model: Any) -> Iterator[None]:
    """FSDP2's counterpart of DDP's ``no_sync``: accumulate unsharded gradients locally."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def add_grads(total: torch.Tensor | None, grad: torch.Tensor | None) -> torch.Tensor | None:
    """total + grad as an all-reduce adds them: a process without a gradient adds zeros."""
    if grad is None:
        return None if total is None else total + torch.zeros_like(total)
    grad = grad.detach()
    return (torch.zeros_like(grad) if total is None else total) + grad
