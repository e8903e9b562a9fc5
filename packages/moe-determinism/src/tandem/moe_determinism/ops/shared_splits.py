"""Query rows that read the same KV split share one fixed-shape GEMM block.

Split attention computes, per (query block, KV split) pair, a `[Q_BLOCK, D] @ [D, split]`
GEMM whose first `live` rows are real. Decoding leaves most of a block as zero padding (a KV
head's two or three query heads, one query each), and every pair gathers its own copy of
the split's keys and values. When several pairs read splits with the same bits, as the
samples of a GRPO group do over their shared prompt (the KV cache's `origins`), their
real rows can be stacked into one block: one gather of the split, one GEMM, each row's
result unchanged, since a fixed-shape GEMM gives a row the same bits whatever the other
rows of its block hold and wherever in the block it sits (`gemm.py`).

`SharedSplits` is the bookkeeping: which block and which rows of it each pair gets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.moe_determinism.errors import MoEDeterminismError
from tandem.moe_determinism.ops.tiles import aligned_zeros


@dataclass(frozen=True)
class SharedSplits:
    """Pairs packed into blocks of `block_rows` rows, `live` rows per pair.

    kv_block [blocks]: the KV split every pair of the block reads.
    rows [pairs * live]: where each pair's rows sit in the flattened [blocks * block_rows].
    """

    kv_block: torch.Tensor
    rows: torch.Tensor
    live: int
    block_rows: int

    @staticmethod
    def build(kv_block_of: torch.Tensor, live: int, block_rows: int) -> SharedSplits:
        """Group the pairs by the split they read (``kv_block_of`` [pairs]), ``block_rows //
        live`` pairs per block; a split read by more pairs gets more blocks."""
        per_block = block_rows // live
        if per_block < 1:
            raise MoEDeterminismError(f"{live} live rows do not fit a block of {block_rows}")
        splits, group = torch.unique(kv_block_of, return_inverse=True)
        counts = torch.bincount(group, minlength=splits.numel())
        order = torch.argsort(group, stable=True)
        first = torch.cumsum(counts, 0) - counts
        rank = torch.empty_like(group)
        rank[order] = torch.arange(group.numel(), device=group.device) - first[group[order]]
        blocks_per_split = -(-counts // per_block)
        block_start = torch.cumsum(blocks_per_split, 0) - blocks_per_split
        block = block_start[group] + rank // per_block
        row0 = block * block_rows + (rank % per_block) * live
        rows = (row0[:, None] + torch.arange(live, device=row0.device)[None, :]).reshape(-1)
        kv_block = torch.repeat_interleave(splits, blocks_per_split)
        return SharedSplits(kv_block=kv_block, rows=rows, live=live, block_rows=block_rows)

    @property
    def blocks(self) -> int:
        return self.kv_block.numel()

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[pairs, live, C] -> [blocks, block_rows, C], the rows no pair uses zero."""
        c = x.shape[-1]  # rows aligned as the products want them: no copy there
        flat = aligned_zeros((self.blocks * self.block_rows, c), x.dtype, x.device)
        flat.index_copy_(0, self.rows, x.reshape(-1, c))
        return flat.view(self.blocks, self.block_rows, c)

    def unpack(self, y: torch.Tensor) -> torch.Tensor:
        """[blocks, block_rows, C] -> [pairs, live, C]: each pair's rows back."""
        c = y.shape[-1]
        return y.reshape(-1, c).index_select(0, self.rows).view(-1, self.live, c)
