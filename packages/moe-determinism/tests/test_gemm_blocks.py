"""The blocked GEMM kernels batch their fixed-shape blocks into few `torch.bmm` calls; each
block must still be bit for bit the single fixed-shape product (the slow reference here)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.moe_determinism.ops import gemm


def _block_rows(x: torch.Tensor, lo: int, r: int) -> torch.Tensor:
    """Rows lo..lo+r as a contiguous block (zero rows appended past the end)."""
    chunk = x[..., lo : lo + r, :]
    return F.pad(chunk, (0, 0, 0, r - chunk.shape[-2])).contiguous()


def _mm_per_block(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """One `torch.mm` per zero-padded block of r rows."""
    r = gemm.row_block(a.dtype)
    parts = [torch.mm(_block_rows(a, lo, r), b) for lo in range(0, a.shape[0], r)]
    return torch.cat(parts)[: a.shape[0]] if parts else a.new_zeros(0, b.shape[1])


def _bmm_per_block(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """One `torch.bmm` per zero-padded block of r rows of every matrix."""
    r = gemm.row_block(a.dtype)
    parts = [torch.bmm(_block_rows(a, lo, r), b) for lo in range(0, a.shape[1], r)]
    return torch.cat(parts, dim=1)[:, : a.shape[1]]


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32 if x.dtype == torch.float32 else torch.int16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mm_blocks_equal_one_product_per_block(threads: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(threads)
    for m, k, n in [(1, 64, 96), (37, 300, 200), (160, 128, 48), (0, 8, 8)]:
        a = torch.randn(m, k, generator=gen).to(dtype)
        w = torch.randn(n, k, generator=gen).to(dtype)
        # A transposed weight (what F.linear passes) and a transposed activation.
        for lhs, rhs in [(a, w.t()), (a.t().contiguous().t(), w.t().contiguous())]:
            assert torch.equal(_bits(gemm.mm_blocks(lhs, rhs)), _bits(_mm_per_block(lhs, rhs)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bmm_blocks_equal_one_product_per_block(threads: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(threads)
    # Few matrices of many rows (MoE experts) and many matrices of few rows.
    for g, m, k, n in [(3, 70, 64, 40), (20, 5, 32, 24)]:
        a = torch.randn(g, m, k, generator=gen).to(dtype)
        w = torch.randn(g, n, k, generator=gen).to(dtype)
        ours = gemm.bmm_blocks(a, w.transpose(1, 2))
        assert torch.equal(_bits(ours), _bits(_bmm_per_block(a, w.transpose(1, 2))))
