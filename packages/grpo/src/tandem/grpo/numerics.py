"""Finite-by-construction log-space arithmetic shared by the loss, KL and IS code.

Importance ratios overflow to inf (and then NaN through ``0 * inf``) when log-prob gaps are
large or a log-prob is -inf. Every ratio in this package is therefore formed as
``exp(clamp(log_a - log_b))`` after three repairs, in this order:

1. positions outside the mask get a log ratio of exactly 0 (padding may hold anything);
2. an undefined difference (``-inf - -inf`` or any NaN) becomes 0 with no gradient;
3. the result is clamped to ``[-c, c]``; ``+-inf`` land on the bounds, with zero gradient.

``torch.where`` is used rather than multiplication by the mask so that a NaN or inf in a
discarded position never reaches the backward pass.
"""

from __future__ import annotations

import torch

from tandem.grpo.errors import GRPOError


def safe_log_ratio(
    log_num: torch.Tensor, log_den: torch.Tensor, mask: torch.Tensor, clamp: float
) -> torch.Tensor:
    """``log_num - log_den`` made finite: 0 outside ``mask`` or where undefined, then clamped."""
    diff = log_num - log_den
    valid = mask & ~torch.isnan(diff)
    diff = torch.where(valid, diff, torch.zeros_like(diff))
    return diff.clamp(-clamp, clamp)


def as_float(x: torch.Tensor) -> torch.Tensor:
    """At least fp32: bf16/fp16 are upcast, fp64 is kept (the references test in fp64)."""
    return x if x.dtype == torch.float64 else x.float()


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` holds; non-finite values outside the mask are ignored."""
    picked = torch.where(mask, values, torch.zeros_like(values))
    return picked.sum() if dim is None else picked.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the masked positions; 0 when the mask is empty."""
    count = mask.sum()
    return masked_sum(values, mask) / count.clamp(min=1)


def check_token_tensors(mask: torch.Tensor, **tensors: torch.Tensor | None) -> torch.Tensor:
    """Validate [B, T] token tensors against ``mask`` and return the mask as bool."""
    if mask.dim() != 2:
        raise GRPOError(f"mask must be [batch, tokens], got shape {tuple(mask.shape)}")
    for name, tensor in tensors.items():
        if tensor is None:
            continue
        if tensor.shape != mask.shape:
            raise GRPOError(
                f"{name} has shape {tuple(tensor.shape)} but mask has {tuple(mask.shape)}; "
                "every per-token tensor must be [batch, tokens] and aligned with the mask"
            )
        if not tensor.is_floating_point():
            raise GRPOError(f"{name} must be a floating-point tensor, got {tensor.dtype}")
    return mask.bool()
