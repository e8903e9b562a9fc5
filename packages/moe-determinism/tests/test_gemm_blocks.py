"""The CPU GEMMs equal, bit for bit, the tile computation their docstring promises, written
out here the slow way: one `torch.mm` per (row tile, K tile) on one thread, the row tile
zero-padded, the K-tile partials added in order."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.moe_determinism import batch_invariant
from tandem.moe_determinism.ops import gemm, tiles


def _reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[M, K] @ [K, N] tile by tile, on the calling thread with one torch thread."""
    r, kt = tiles.ROW_TILE, tiles.K_TILE
    m, k = a.shape
    rows = []
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for lo in range(0, m, r):
            block = F.pad(a[lo : lo + r], (0, 0, 0, r - a[lo : lo + r].shape[0])).contiguous()
            cols = []
            for c0 in range(0, b.shape[1], tiles.COL_TILE):
                acc = None
                for k0 in range(0, k, kt):
                    part = torch.mm(
                        block[:, k0 : k0 + kt], b[k0 : k0 + kt, c0 : c0 + tiles.COL_TILE]
                    )
                    first = part if k0 + kt >= k else part.float()
                    acc = first if acc is None else acc + part
                cols.append(acc.to(a.dtype))
            rows.append(torch.cat(cols, 1))
    finally:
        torch.set_num_threads(before)
    return torch.cat(rows)[:m] if rows else a.new_zeros(0, b.shape[1])


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32 if x.dtype == torch.float32 else torch.int16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mm_blocks_equal_the_tile_computation(threads: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(threads)
    # one tile, a K tail (K > K_TILE), a column tail (N > COL_TILE), no rows
    for m, k, n in [(1, 64, 96), (37, 1100, 200), (20, 128, 515), (0, 8, 8)]:
        a = torch.randn(m, k, generator=gen).to(dtype)
        w = torch.randn(n, k, generator=gen).to(dtype)
        # A transposed weight (what F.linear passes) and a transposed activation.
        for lhs, rhs in [(a, w.t()), (a.t().contiguous().t(), w.t().contiguous())]:
            assert torch.equal(_bits(gemm.mm_blocks(lhs, rhs)), _bits(_reference(lhs, rhs)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bmm_blocks_equal_the_tile_computation(threads: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(threads)
    # Few matrices of many rows (MoE experts) and many matrices of few rows.
    for g, m, k, n in [(3, 70, 64, 40), (20, 5, 32, 24)]:
        a = torch.randn(g, m, k, generator=gen).to(dtype)
        w = torch.randn(g, n, k, generator=gen).to(dtype)
        ours = gemm.bmm_blocks(a, w.transpose(1, 2))
        for i in range(g):
            assert torch.equal(_bits(ours[i]), _bits(_reference(a[i], w[i].t())))


def test_bmm_blocks_take_whole_aligned_tiles_where_they_lie(monkeypatch) -> None:
    """Experts' rows allocated in whole row tiles are multiplied in place (no padded copy),
    with the bits of the padded copy."""
    gen = torch.Generator().manual_seed(4)
    a = torch.randn(4, 2 * tiles.ROW_TILE, 64, generator=gen)
    w = torch.randn(4, 48, 64, generator=gen)
    copies: list[tuple[int, ...]] = []
    pad_rows = tiles.pad_rows

    def recorded(t: torch.Tensor, *args: int) -> torch.Tensor:
        copies.append(tuple(t.shape))
        return pad_rows(t, *args)

    monkeypatch.setattr(tiles, "pad_rows", recorded)
    in_place = gemm.bmm_blocks(a, w.transpose(1, 2))
    assert copies == []
    padded = gemm.bmm_blocks(a[:, :-1], w.transpose(1, 2))  # a partial tile: copied
    assert copies == [(4, 2 * tiles.ROW_TILE - 1, 64)]
    assert torch.equal(in_place[:, :-1], padded)
    for i in range(4):
        assert torch.equal(_bits(in_place[i]), _bits(_reference(a[i], w[i].t())))


def test_workers_leave_the_callers_thread_count_alone(threads: int) -> None:
    """The single-threaded workers do not change the count of the caller or of threads
    started later (torch records the last count set for threads it has not seen yet)."""
    import threading

    gemm.mm(torch.randn(40, 600), torch.randn(600, 700))
    seen: list[int] = []
    t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert torch.get_num_threads() == threads
    assert seen == [threads]


def test_backward_through_the_tile_products(threads: int) -> None:
    """Gradients flow through every product `batch_invariant()` covers, with products large
    enough to be shared by the workers and with K over one tile: no tile product ever runs
    its `out=` kernel on operands that record a graph (which autograd refuses)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 100, 600, generator=gen)
    w = torch.randn(300, 600, generator=gen)
    bx = torch.randn(3, 40, 600, generator=gen)
    bw = torch.randn(3, 600, 90, generator=gen)
    q = torch.randn(20, 16, 24, generator=gen)
    kt = torch.randn(20, 24, 33, generator=gen)

    def loss(x, w, bx, bw, q, kt):
        out = F.linear(x, w).square().mean() + torch.matmul(x, w.t()).mean()
        out = out + torch.bmm(bx, bw).square().mean() + gemm.fixed_shape_bmm(q, kt).mean()
        return out + gemm.mm(x[0], w.t()).mean() + gemm.bmm(bx, bw).mean()

    leaves = [t.clone().requires_grad_() for t in (x, w, bx, bw, q, kt)]
    with batch_invariant():
        loss(*leaves).backward()
    stock = [t.clone().requires_grad_() for t in (x, w, bx, bw, q, kt)]
    loss(*stock).backward()
    for ours, ref in zip(leaves, stock, strict=True):
        torch.testing.assert_close(ours.grad, ref.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("d", "transposed"), [(64, True), (24, True), (64, False), (24, False)])
@pytest.mark.parametrize("items", [5, 16, 53, 200])
def test_indexed_products_have_the_bits_of_the_gathered_batch(
    threads: int, dtype: torch.dtype, d: int, transposed: bool, items: int
) -> None:
    """`fixed_shape_bmm_indexed` reads each item's block where it lies (runs of one block, as
    sorted attention pairs give, and mixed windows): the bits of `fixed_shape_bmm` on the
    gathered blocks, and the products of a float64 reference. d 24: rows the caches hold
    unaligned; items 5: fewer than one batched call."""
    from tandem.moe_determinism.ops import workers

    gen = torch.Generator().manual_seed(items * 7 + d)
    source = torch.randn(11, 64, d, generator=gen).to(dtype)  # [blocks, split, d]
    runs = torch.randint(0, 11, (items // 7 + 1,), generator=gen).repeat_interleave(7)
    # a run of 20 (whole windows of one block), then runs of 7 (mixed windows)
    index = torch.cat([torch.full((20,), 3), runs])[:items]
    a = torch.randn(items, 16, d if transposed else 64, generator=gen).to(dtype)
    before, shared = torch.get_num_threads(), workers.SHARED_WORK
    torch.set_num_threads(threads)
    workers.SHARED_WORK = 0
    try:
        got = gemm.fixed_shape_bmm_indexed(a, source, index, transposed=transposed)
        blocks = source.index_select(0, index)
        want = gemm.fixed_shape_bmm(a, blocks.transpose(1, 2) if transposed else blocks)
    finally:
        torch.set_num_threads(before)
        workers.SHARED_WORK = shared
    assert torch.equal(got, want)
    b = blocks.double().transpose(1, 2) if transposed else blocks.double()
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.double(), a.double() @ b, rtol=tol, atol=tol * 8)
