"""Scored trajectories as one right-padded `RolloutBatch`, with the routes the engine recorded."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tandem.grpo import RolloutBatch
from tandem.orchestrator.wire import Sample, Segment


def collate(groups: Sequence[Sequence[Sample]]) -> RolloutBatch:
    """Right-padded batch of every sample of ``groups`` (one group id per group).

    An episode that compacted its context is one row per segment (`Sample.segments`), each
    with the episode's reward and group; ``episode_ids`` then says which rows are one episode
    (grpo takes advantages over episodes and the sequence losses over whole episodes). A
    batch without such an episode has no ``episode_ids``.

    ``extras["routes_known"]``: whether every sample carries the experts its engine used
    (an engine that cannot report them marks each with -1; R3 replay then has nothing to
    replay, and the routing-agreement checks nothing to compare)."""
    samples = [s for g in groups for s in g]
    if not samples:
        raise ValueError("cannot collate an empty list of groups")
    rows: list[tuple[int, int, Segment]] = []  # (group, episode, segment) of each row
    episodes = 0
    for gi, g in enumerate(groups):
        for s in g:
            rows += [(gi, episodes, seg) for seg in s.segments()]
            episodes += 1
    b, t = len(rows), max(len(seg.tokens) for _, _, seg in rows)
    layers, top_k = samples[0].routes.shape[1:]
    ids = torch.zeros(b, t, dtype=torch.long)
    attn = torch.zeros(b, t, dtype=torch.bool)
    mask = torch.zeros(b, t, dtype=torch.bool)
    lps = torch.zeros(b, t, dtype=torch.float32)
    known = all(int(seg.routes.min(initial=0)) >= 0 for _, _, seg in rows)
    wide = max(int(seg.routes.max(initial=0)) for _, _, seg in rows) > 255
    route_dtype = torch.int32 if wide else torch.uint8
    routes = torch.zeros(b, max(t - 1, 1), layers, top_k, dtype=route_dtype)
    for i, (_, _, seg) in enumerate(rows):
        n = len(seg.tokens)
        ids[i, :n] = torch.tensor(seg.tokens)
        attn[i, :n] = True
        mask[i, :n] = torch.tensor(seg.loss_mask, dtype=torch.bool)
        lps[i, :n] = torch.tensor(seg.logprobs, dtype=torch.float32)
        routes[i, : n - 1] = torch.from_numpy(seg.routes.astype(np.int64)).to(route_dtype)
    episode = [e for _, e, _ in rows]
    return RolloutBatch(
        input_ids=ids,
        loss_mask=mask,
        rollout_logprobs=lps,
        rewards=torch.tensor([samples[e].reward for e in episode], dtype=torch.float32),
        group_ids=torch.tensor([gi for gi, _, _ in rows], dtype=torch.long),
        policy_version=torch.tensor([seg.min_version for _, _, seg in rows], dtype=torch.long),
        attention_mask=attn,
        episode_ids=torch.tensor(episode, dtype=torch.long) if b > len(samples) else None,
        extras={
            "routes": routes,
            "routes_known": torch.tensor(known),
            "row": torch.arange(b),
            "max_version": torch.tensor([seg.max_version for _, _, seg in rows], dtype=torch.long),
        },
    )
