"""The autograd pieces of the CPU split attention's block grid (`split_attention`): the
gather of query, key and value blocks for the (query block, KV split) pairs it computes, and
the sum over splits in the dense grid's fixed tree order."""

from __future__ import annotations

import torch

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

    Forward places the values in a zero-filled dense [blocks, n_sp, ...] grid and applies
    `tree_sum` over the splits: the reduction order of the dense computation, skipped pairs
    being its exact zeros. Backward: every leaf of a sum has derivative one, so a pair's
    gradient is its block's output gradient (exact, no graph through the tree)."""

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
        grid = values.new_zeros(blocks * n_sp, *values.shape[1:])
        grid.index_copy_(0, pair, values)
        return tree_sum(grid.view(blocks, n_sp, *values.shape[1:]), dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:  # type: ignore[override]
        (block_of,) = ctx.saved_tensors
        return grad.index_select(0, block_of), None, None, None, None
