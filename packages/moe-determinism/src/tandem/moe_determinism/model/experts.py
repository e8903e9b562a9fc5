"""Routed expert products without padding: each expert multiplies only the rows routed to it.

Stacking every expert's rows into one [experts, busiest expert's rows, hidden] batch makes
every expert pay for the busiest one: with a skewed router (one expert taking half of a
layer's slots) the products do about twice the work they need, and the zero padding is
written and copied on every pass. Here the (token, slot) pairs are sorted by expert, each
expert's rows lie in one contiguous segment, and the SwiGLU runs segment by segment with
`F.linear`, so `batch_invariant()` makes each product row-invariant and a row's bits depend
only on the row and its expert's weights, not on how many rows the expert got.

Under `batch_invariant()` on the CPU each segment starts on a whole row tile
(`ops.tiles.ROW_TILE`), so the tiled products read the segment in place instead of copying
it into tiles; the few rows that fill the last tile are zero and their outputs are dropped.
Experts that no row reaches are skipped. The per-expert weights are views from one
`unbind`, whose backward stacks their gradients into each stacked parameter once.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from tandem.moe_determinism.mode import is_batch_invariant
from tandem.moe_determinism.ops.tiles import ROW_TILE

__all__ = ["routed_experts"]


def routed_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    gate_proj: torch.Tensor,
    up_proj: torch.Tensor,
    down_proj: torch.Tensor,
) -> torch.Tensor:
    """SwiGLU experts on the rows routed to them.

    x [tokens, hidden]; ids [tokens, top_k] expert of each (token, slot); gate_proj and
    up_proj [experts, ffn, hidden], down_proj [experts, hidden, ffn]. Returns [tokens, top_k,
    hidden]: slot j of token t holds expert ids[t, j]'s output for x[t]."""
    tokens, k = ids.shape
    experts, hidden = gate_proj.shape[0], x.shape[-1]
    flat = ids.reshape(-1)  # [tokens * k]
    if flat.numel() == 0:
        return x.new_zeros(tokens, k, hidden)
    order = torch.argsort(flat, stable=True)  # slots grouped by expert, token order within
    per_expert = torch.bincount(flat, minlength=experts)
    counts = per_expert.tolist()
    tile = ROW_TILE if is_batch_invariant() and not x.is_cuda else 1
    sizes = [-(-c // tile) * tile for c in counts]  # each segment in whole row tiles
    seg_start = [0, *itertools.accumulate(sizes)][:-1]
    gathered = x[order // k]  # the sorted slots' rows
    if tile == 1:
        rows, where = gathered, None
    else:  # sorted slot i goes to its expert's segment start plus its rank there
        expert_of = flat[order]
        rank = (
            torch.arange(flat.numel(), device=x.device)
            - (torch.cumsum(per_expert, 0) - per_expert)[expert_of]
        )
        where = torch.tensor(seg_start, device=x.device)[expert_of] + rank
        rows = x.new_zeros(sum(sizes), hidden).index_put((where,), gathered)
    gates, ups, downs = gate_proj.unbind(0), up_proj.unbind(0), down_proj.unbind(0)
    outs = []
    for e in range(experts):
        if counts[e]:
            seg = rows[seg_start[e] : seg_start[e] + sizes[e]]
            hid = F.silu(F.linear(seg, gates[e])) * F.linear(seg, ups[e])
            outs.append(F.linear(hid, downs[e]))
    done = torch.cat(outs) if len(outs) > 1 else outs[0]
    if where is not None:
        done = done[where]  # the padding rows dropped
    # back to (token, slot) order
    slots = x.new_empty(flat.numel(), hidden).index_put((order,), done)
    return slots.view(tokens, k, hidden)
