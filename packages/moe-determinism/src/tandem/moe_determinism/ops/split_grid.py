"""The autograd pieces of the CPU split attention's block grid (`split_attention`): the
gather of query, key and value blocks for the (query block, KV split) pairs it computes, and
the sum over splits in the dense grid's fixed tree order."""

from __future__ import annotations

import torch

from tandem.moe_determinism.errors import MoEDeterminismError
from tandem.moe_determinism.ops.reduction import tree_sum


class GatherBlocks(torch.autograd.Function):
    """`source.index_select(0, index)` whose backward accumulates with `index_add_` on 2-D
    views (torch's own formula on the 3-D blocks is several times slower on the CPU)."""

    @staticmethod
    def forward(ctx, source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(index)
        ctx.rows = source.shape[0]
        return source.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        (index,) = ctx.saved_tensors
        # On 2-D views: torch's CPU index_add_ is several times faster on [rows, features].
        out = grad.new_zeros(ctx.rows, grad[0].numel())
        out.index_add_(0, index, grad.reshape(grad.shape[0], -1))
        return out.view(ctx.rows, *grad.shape[1:]), None


class SplitTreeSum(torch.autograd.Function):
    """Per-pair values -> their fixed tree sum over all splits of each query block.

    Forward gives the bits of placing the values in a zero-filled dense [blocks, n_sp, ...]
    grid and applying `tree_sum` over the splits (the reduction order of the dense
    computation, skipped pairs being its exact zeros), without that grid: see
    `prefix_tree_sum`. Backward: every leaf of a sum has derivative one, so a pair's gradient
    is its block's output gradient (exact, no graph through the tree)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        values: torch.Tensor,
        pair: torch.Tensor,
        block_of: torch.Tensor,
        blocks: int,
        n_sp: int,
    ) -> torch.Tensor:
        ctx.save_for_backward(block_of)
        return prefix_tree_sum(values, pair, block_of, blocks, n_sp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:  # type: ignore[override]
        (block_of,) = ctx.saved_tensors
        return grad.index_select(0, block_of), None, None, None, None


CALL_ELEMENTS = 1 << 15
"""About what one group's calls cost in `prefix_tree_sum`, in elements copied and summed
(measured on the CPU): it groups blocks by tree depth when the groups this saves cost more
than summing the zeros the padding adds (a decode step), else by prefix length (a prefill)."""


def _depth(n: int) -> int:
    """Levels of `tree_sum` over n leaves."""
    return max(0, n - 1).bit_length()


def prefix_tree_sum(
    values: torch.Tensor, pair: torch.Tensor, block_of: torch.Tensor, blocks: int, n_sp: int
) -> torch.Tensor:
    """`tree_sum` over the splits of the dense grid [blocks, n_sp, ...] holding ``values[i]``
    at flat position ``pair[i]`` (= block * n_sp + split) and +0 elsewhere, bit for bit,
    when each block's pairs are a prefix of its splits (a block reads the keys before a
    limit: attention's active pairs).

    Why it is exact: in the dense tree, a node over zero leaves only is +0, and a node
    pairing a value with it computes value + 0, which is what `tree_sum` does to an odd
    element out. So the tree over a block's first `a` splits is the dense tree, level for
    level, until it has one element left; where the dense tree has more levels, they only
    add +0 to that element again (which turns -0 into +0 and changes nothing else). Blocks
    are summed in groups of equal prefix length: no zero-filled grid, no sums of zeros.

    A decode step's blocks have as many prefix lengths as a prefill's but few rows each and
    small sums, so a group per length costs mostly the calls. There the blocks whose trees
    have the same number of levels are summed together instead, each padded with zeros to
    that power of two: the tree over `a` leaves is by definition (`tree_sum`) the tree over
    them so padded, so the bits are the same, in a handful of groups (`CALL_ELEMENTS`)."""
    if values.shape[0] != pair.shape[0] or block_of.shape[0] != pair.shape[0]:
        raise MoEDeterminismError(
            f"split sums: {values.shape[0]} values for {pair.shape[0]} pairs "
            f"and {block_of.shape[0]} blocks"
        )
    out = values.new_zeros(blocks, *values.shape[1:])
    if pair.numel() == 0:
        return out
    dev = values.device
    prefix = torch.bincount(block_of, minlength=blocks)
    # where[flat grid position] -> its value's row; -1 where the grid holds no pair
    where = torch.full((blocks * n_sp,), -1, dtype=torch.long, device=dev)
    where[pair] = torch.arange(pair.numel(), device=dev)
    used = prefix > 0
    depth = torch.where(prefix > 1, torch.log2((prefix - 1).double()).floor() + 1, 0).long()
    lengths, depths = torch.unique(prefix[used]), torch.unique(depth[used])
    zeros_added = int(((1 << depth[used]) - prefix[used]).sum()) * values[0].numel()
    by_depth = (lengths.numel() - depths.numel()) * CALL_ELEMENTS > zeros_added
    if by_depth:  # a zero row for the padding
        values = torch.cat([values, values.new_zeros(1, *values.shape[1:])])
    key, keys = (depth, depths) if by_depth else (prefix, lengths)
    zero = pair.numel()  # the zero row (by depth)
    for k in keys.tolist():
        rows = ((key == k) & used).nonzero().squeeze(1)
        width = 1 << k if by_depth else k
        split = torch.arange(width, device=dev)
        pos = where[rows[:, None] * n_sp + split.clamp_max(n_sp - 1)[None, :]]
        if by_depth:  # past a block's own splits: the zero row
            pos = torch.where(split[None, :] < prefix[rows, None], pos, zero)
        if bool((pos < 0).any()):
            raise MoEDeterminismError("split sums: a block's pairs are not a prefix of its splits")
        leaves = values.index_select(0, pos.reshape(-1))
        summed = tree_sum(leaves.view(rows.numel(), width, *values.shape[1:]), dim=1)
        if (k if by_depth else _depth(k)) < _depth(n_sp):
            summed = summed + 0.0
        out.index_copy_(0, rows, summed)
    return out
