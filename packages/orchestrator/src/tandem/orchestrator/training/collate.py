"""Scored trajectories as one right-padded `RolloutBatch`, with the routes the engine recorded."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tandem.grpo import RolloutBatch
from tandem.orchestrator.wire import Sample


def collate(groups: Sequence[Sequence[Sample]]) -> RolloutBatch:
    """Right-padded batch of every sample of ``groups`` (one group id per group).

    ``extras["routes_known"]``: whether every sample carries the experts its engine used
    (an engine that cannot report them marks each with -1; R3 replay then has nothing to
    replay, and the routing-agreement checks nothing to compare)."""
    samples = [s for g in groups for s in g]
    if not samples:
        raise ValueError("cannot collate an empty list of groups")
    b, t = len(samples), max(len(s.tokens) for s in samples)
    layers, top_k = samples[0].routes.shape[1:]
    ids = torch.zeros(b, t, dtype=torch.long)
    attn = torch.zeros(b, t, dtype=torch.bool)
    mask = torch.zeros(b, t, dtype=torch.bool)
    lps = torch.zeros(b, t, dtype=torch.float32)
    known = all(int(s.routes.min(initial=0)) >= 0 for s in samples)
    wide = max(int(s.routes.max(initial=0)) for s in samples) > 255
    route_dtype = torch.int32 if wide else torch.uint8
    routes = torch.zeros(b, max(t - 1, 1), layers, top_k, dtype=route_dtype)
    for i, s in enumerate(samples):
        n = len(s.tokens)
        ids[i, :n] = torch.tensor(s.tokens)
        attn[i, :n] = True
        mask[i, :n] = torch.tensor(s.loss_mask, dtype=torch.bool)
        lps[i, :n] = torch.tensor(s.logprobs, dtype=torch.float32)
        routes[i, : n - 1] = torch.from_numpy(s.routes.astype(np.int64)).to(route_dtype)
    group_ids = torch.tensor([gi for gi, g in enumerate(groups) for _ in g], dtype=torch.long)
    return RolloutBatch(
        input_ids=ids,
        loss_mask=mask,
        rollout_logprobs=lps,
        rewards=torch.tensor([s.reward for s in samples], dtype=torch.float32),
        group_ids=group_ids,
        policy_version=torch.tensor([s.min_version for s in samples], dtype=torch.long),
        attention_mask=attn,
        extras={
            "routes": routes,
            "routes_known": torch.tensor(known),
            "row": torch.arange(b),
            "max_version": torch.tensor([s.max_version for s in samples], dtype=torch.long),
        },
    )
