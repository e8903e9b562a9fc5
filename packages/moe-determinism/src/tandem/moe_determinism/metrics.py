"""Train/inference agreement metrics: log-prob mismatch and routing agreement."""

from __future__ import annotations

import msgspec
import numpy as np
import torch

from tandem.moe_determinism.errors import MoEDeterminismError
from tandem.moe_determinism.replay import RoutingTrace


class LogprobComparison(msgspec.Struct, frozen=True):
    """a = reference (e.g. trainer), b = other (e.g. inference engine), over masked tokens.

    k1 = mean(log a - log b) estimates KL(a || b) with samples from a (Composer 2's choice);
    k3 = mean(exp(lb - la) - 1 - (lb - la)), the non-negative, lower-variance estimator.
    """

    tokens: int
    max_abs_diff: float
    mean_abs_diff: float
    kl_k1: float
    kl_k3: float
    frac_tokens_differ: float


class RoutingAgreement(msgspec.Struct, frozen=True):
    """per_decision: fraction of (token, layer) routing decisions with the same expert set;
    per_token: fraction of tokens whose expert sets agree in every layer."""

    tokens: int
    per_decision: float
    per_token: float


def compare_logprobs(
    a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None
) -> LogprobComparison:
    """Compare per-token log-probs of the same tokens from two computations."""
    if a.shape != b.shape:
        raise MoEDeterminismError(
            f"log-prob tensors differ in shape: {tuple(a.shape)} vs {tuple(b.shape)}"
        )
    m = torch.ones_like(a, dtype=torch.bool) if mask is None else mask.to(torch.bool)
    if m.shape != a.shape:
        raise MoEDeterminismError(f"mask shape {tuple(m.shape)} != log-prob shape {tuple(a.shape)}")
    la, lb = a.double()[m], b.double()[m]
    n = int(la.numel())
    if n == 0:
        return LogprobComparison(0, 0.0, 0.0, 0.0, 0.0, 0.0)
    d = la - lb
    r = lb - la
    return LogprobComparison(
        tokens=n,
        max_abs_diff=float(d.abs().max()),
        mean_abs_diff=float(d.abs().mean()),
        kl_k1=float(d.mean()),
        kl_k3=float((torch.exp(r) - 1 - r).mean()),
        frac_tokens_differ=float((a[m] != b[m]).float().mean()),
    )


def _as_ids(x: RoutingTrace | np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(x, RoutingTrace):
        return x.expert_ids.astype(np.int64)
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy().astype(np.int64)
    return np.asarray(x, dtype=np.int64)


def routing_agreement(
    a: RoutingTrace | np.ndarray | torch.Tensor, b: RoutingTrace | np.ndarray | torch.Tensor
) -> RoutingAgreement:
    """Agreement of two routings [tokens, layers, top_k] of the same tokens (order-insensitive
    within a decision: expert sets are compared)."""
    ia, ib = _as_ids(a), _as_ids(b)
    if ia.shape != ib.shape or ia.ndim != 3:
        raise MoEDeterminismError(
            f"routings must both be [tokens, layers, top_k]; got {ia.shape} and {ib.shape}"
        )
    if ia.shape[0] == 0:
        return RoutingAgreement(0, 1.0, 1.0)
    same = (np.sort(ia, axis=-1) == np.sort(ib, axis=-1)).all(-1)  # [tokens, layers]
    return RoutingAgreement(
        tokens=ia.shape[0], per_decision=float(same.mean()), per_token=float(same.all(-1).mean())
    )
