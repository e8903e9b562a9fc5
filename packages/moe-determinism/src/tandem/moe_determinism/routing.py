"""Deterministic MoE routing: fp32 scores, top-k with ties to the lower expert id, sorted ids,
and a fixed-order fp32 combine of expert outputs.

Why each piece: a router computed in bf16 flips near-ties between engine and trainer; torch's
`topk` does not promise which of two equal scores wins; and the same experts summed in a
different order give different bf16 bits, so ids are kept in ascending order and expert
outputs are added in that order, in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.moe_determinism.errors import MoEDeterminismError


@dataclass(frozen=True)
class Routing:
    """One MoE layer's routing for a batch of tokens.

    ids [tokens, top_k] ascending expert ids; weights [tokens, top_k] fp32 gate weights
    (differentiable w.r.t. the router); probs [tokens, experts] the full fp32 router scores.
    """

    ids: torch.Tensor
    weights: torch.Tensor
    probs: torch.Tensor


def router_probs(logits: torch.Tensor) -> torch.Tensor:
    """Softmax over experts in fp32 (fixed-order sum, so identical for any batch)."""
    from tandem.moe_determinism.ops.reduction import softmax

    return softmax(logits.float(), dim=-1)


def deterministic_topk(probs: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k expert ids per token, ties broken by the lower id, returned in ascending order.

    A stable descending sort keeps equal scores in index order, so the lower id wins a tie.
    """
    if not 0 < k <= probs.shape[-1]:
        raise MoEDeterminismError(f"top_k must be in [1, {probs.shape[-1]}], got {k}")
    order = torch.sort(probs, dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.sort(order, dim=-1).values


def gate_weights(probs: torch.Tensor, ids: torch.Tensor, normalize: bool) -> torch.Tensor:
    """Gate weights gathered from the *full* router scores at `ids`.

    Gathering from the full scores (not from a top-k-masked copy) keeps the gradient path to
    the router alive, which is what makes replayed routes trainable.
    """
    w = probs.gather(-1, ids)
    if normalize:
        w = w / w.sum(-1, keepdim=True)  # k terms, summed in a fixed left-to-right order
    return w


def route(
    logits: torch.Tensor, top_k: int, normalize: bool, replay_ids: torch.Tensor | None = None
) -> Routing:
    """Route tokens from router logits [tokens, experts], or replay given ids [tokens, top_k]."""
    probs = router_probs(logits)
    if replay_ids is None:
        ids = deterministic_topk(probs.detach(), top_k)
    else:
        if replay_ids.shape != (probs.shape[0], top_k):
            raise MoEDeterminismError(
                f"replayed routes have shape {tuple(replay_ids.shape)} but this layer routes "
                f"{probs.shape[0]} tokens to top_k={top_k}; the trace does not match the batch"
            )
        ids = replay_ids.to(device=probs.device, dtype=torch.long)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= probs.shape[-1]):
            raise MoEDeterminismError(
                f"replayed expert ids must be in [0, {probs.shape[-1]}); the trace was recorded "
                "for a model with a different number of experts"
            )
        ids = torch.sort(ids, dim=-1).values
    return Routing(ids=ids, weights=gate_weights(probs, ids, normalize), probs=probs)


def combine(expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_k weights[:, k] * expert_out[:, k] in fp32, k = 0, 1, ... in order.

    expert_out [tokens, top_k, hidden] holds the output of the k-th (ascending id) expert.
    """
    acc = expert_out[:, 0].float() * weights[:, 0:1]
    for slot in range(1, expert_out.shape[1]):
        acc = acc + expert_out[:, slot].float() * weights[:, slot : slot + 1]
    return acc
