"""Deterministic MoE routing: fp32 scores, top-k with ties to the lower expert id, sorted ids,
and a fixed-order fp32 combine of expert outputs. Two routers: softmax top-k (Qwen3-MoE,
Mixtral) and DeepSeek-V3's grouped sigmoid (`grouped_topk`).

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


def grouped_topk(scores: torch.Tensor, k: int, n_group: int, topk_group: int) -> torch.Tensor:
    """DeepSeek-V3's selection: experts in ``n_group`` equal groups, a group scored by the sum
    of its two best scores, the best ``topk_group`` groups kept, then the top ``k`` experts
    among theirs. Ties go to the lower group and expert id; ids ascending."""
    tokens, experts = scores.shape
    per_group = scores.view(tokens, n_group, experts // n_group)
    best2 = torch.sort(per_group, dim=-1, descending=True, stable=True).values[..., :2]
    groups = deterministic_topk(best2[..., 0] + best2[..., 1], topk_group)
    keep = torch.zeros(tokens, n_group, dtype=torch.bool, device=scores.device)
    keep.scatter_(1, groups, True)
    keep = keep.repeat_interleave(experts // n_group, dim=1)
    return deterministic_topk(scores.masked_fill(~keep, float("-inf")), k)


def gate_weights(
    probs: torch.Tensor, ids: torch.Tensor, normalize: bool, eps: float = 0.0
) -> torch.Tensor:
    """Gate weights gathered from the *full* router scores at `ids`.

    Gathering from the full scores (not from a top-k-masked copy) keeps the gradient path to
    the router alive, which is what makes replayed routes trainable.
    """
    w = probs.gather(-1, ids)
    if normalize:  # k terms, summed in a fixed left-to-right order
        w = w / (w.sum(-1, keepdim=True) + eps) if eps else w / w.sum(-1, keepdim=True)
    return w


def route(
    logits: torch.Tensor,
    top_k: int,
    normalize: bool,
    replay_ids: torch.Tensor | None = None,
    *,
    kind: str = "softmax",
    bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    scale: float = 1.0,
) -> Routing:
    """Route tokens from router logits [tokens, experts], or replay given ids [tokens, top_k].

    ``kind="softmax"``: top-k of the softmax scores. ``kind="grouped_sigmoid"`` (DeepSeek-V3):
    scores are sigmoid(logits); ``bias`` (the per-expert correction) is added for choosing
    only (`grouped_topk`); the weights are the chosen experts' unbiased scores, normalised
    (with transformers' 1e-20) when ``normalize``. Either way the weights are then times
    ``scale``, and a replay recomputes them from the current scores at the replayed ids."""
    if kind == "softmax":
        probs, eps = router_probs(logits), 0.0
    elif kind == "grouped_sigmoid":
        probs, eps = torch.sigmoid(logits.float()), 1e-20
    else:
        raise MoEDeterminismError(f"router kind {kind!r}: supported are softmax, grouped_sigmoid")
    if replay_ids is None:
        chosen = probs.detach()
        if kind == "grouped_sigmoid":
            if bias is not None:
                chosen = chosen + bias.float()
            ids = grouped_topk(chosen, top_k, n_group, topk_group)
        else:
            ids = deterministic_topk(chosen, top_k)
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
    weights = gate_weights(probs, ids, normalize, eps)
    if scale != 1.0:
        weights = weights * scale
    return Routing(ids=ids, weights=weights, probs=probs)


def combine(expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_k weights[:, k] * expert_out[:, k] in fp32, k = 0, 1, ... in order.

    expert_out [tokens, top_k, hidden] holds the output of the k-th (ascending id) expert.
    """
    acc = expert_out[:, 0].float() * weights[:, 0:1]
    for slot in range(1, expert_out.shape[1]):
        acc = acc + expert_out[:, slot].float() * weights[:, slot : slot + 1]
    return acc
