"""The CPU GEMMs equal, bit for bit, the tile computation their docstring promises, written
out here the slow way: one `torch.mm` per (row tile, K tile) on one thread, the row tile
zero-padded, the K-tile partials added in order."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from tandem.moe_determinism import batch_invariant
from tandem.moe_determinism.ops import gemm, tiles


def _reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[M, K] @ [K, N] tile by tile, on the calling thread with one torch thread: 16-row
    tiles, the column and K pieces of `tiles.cuts` (checked in `test_cuts_...`)."""
    r = tiles.ROW_TILE
    m, k = a.shape
    rows = []
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for lo in range(0, m, r):
            block = F.pad(a[lo : lo + r], (0, 0, 0, r - a[lo : lo + r].shape[0])).contiguous()
            cols = []
            for c0, c1 in tiles.cuts(b.shape[1], tiles.COL_TILE, a.dtype):
                acc = None
                for k0, k1 in tiles.cuts(k, tiles.K_TILE, a.dtype):
                    part = torch.mm(block[:, k0:k1], b[k0:k1, c0:c1])
                    first = part if k1 >= k else part.float()
                    acc = first if acc is None else acc + part
                cols.append(acc.to(a.dtype))
            rows.append(torch.cat(cols, 1))
    finally:
        torch.set_num_threads(before)
    return torch.cat(rows)[:m] if rows else a.new_zeros(0, b.shape[1])


def test_cuts_are_the_fewest_even_aligned_pieces() -> None:
    f32, bf16 = torch.float32, torch.bfloat16
    assert tiles.cuts(576, 512, f32) == [(0, 288), (288, 576)]
    assert tiles.cuts(1536, 512, f32) == [(0, 512), (512, 1024), (1024, 1536)]
    assert tiles.cuts(520, 512, f32) == [(0, 272), (272, 520)]  # 260 up to 16 floats
    assert tiles.cuts(520, 512, bf16) == [(0, 288), (288, 520)]  # 260 up to 32 halves
    assert tiles.cuts(100, 512, f32) == [(0, 100)]
    assert tiles.cuts(0, 512, f32) == []
    for count in range(1, 2000, 7):
        pieces = tiles.cuts(count, 512, f32)
        assert pieces[0][0] == 0 and pieces[-1][1] == count
        assert all(p[1] == q[0] for p, q in itertools.pairwise(pieces))
        assert all(0 < hi - lo <= 512 and lo % 16 == 0 for lo, hi in pieces)
        assert len(pieces) == -(-count // 512)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32 if x.dtype == torch.float32 else torch.int16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mm_blocks_equal_the_tile_computation(threads: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(threads)
    # one tile, K pieces (K > K_TILE), column pieces (N > COL_TILE), no rows, long tiles
    long = gemm.LONG_ROW_TILE
    for m, k, n in [
        (1, 64, 96),
        (37, 2100, 200),
        (20, 128, 515),
        (0, 8, 8),
        (2 * long + 37, 96, 40),
    ]:
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


# -- long row tiles (`gemm.LONG_ROW_TILE`): taken only where the BLAS gives a row the bits of
# 16-row tiles, and then with those bits, so an engine decoding 16 rows at a time and a
# trainer scoring thousands agree.


def _tile_lengths(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The row-tile lengths `mm_blocks` asks for, as it asks."""
    seen: list[int] = []
    real = tiles.row_tiles

    def spy(a: torch.Tensor, rows: int = tiles.ROW_TILE) -> torch.Tensor:
        seen.append(rows)
        return real(a, rows)

    monkeypatch.setattr(tiles, "row_tiles", spy)
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_tiles_have_the_bits_of_short_ones(
    threads: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = torch.Generator().manual_seed(threads)
    long = gemm.LONG_ROW_TILE
    for m, k, n in [(long, 96, 96), (2 * long + 37, 576, 600), (long + 16, 2100, 40)]:
        a = torch.randn(m, k, generator=gen).to(dtype)
        w = torch.randn(n, k, generator=gen).to(dtype)
        seen = _tile_lengths(monkeypatch)
        ours = gemm.mm_blocks(a, w.t())
        assert torch.equal(_bits(ours), _bits(_reference(a, w.t())))
        assert (long in seen) == gemm.tiles_agree(w.t(), long)


def test_fitted_rows_are_few_heights() -> None:
    assert [gemm.fitted_rows(m) for m in (1, 3, 4, 5, 8, 9, 16, 17, 32, 100, 128)] == [
        4, 4, 4, 8, 8, 16, 16, 32, 32, 112, 128,
    ]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fitted_tiles_have_the_bits_of_short_ones(
    threads: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode step's rows (and the rows after the last long tile) take one tile of their
    own count rounded up, where the BLAS gives a row the bits of 16-row tiles."""
    gen = torch.Generator().manual_seed(threads)
    long = gemm.LONG_ROW_TILE
    for m, k, n in [(1, 96, 40), (3, 576, 300), (5, 64, 96), (17, 2100, 40), (32, 576, 600),
                    (100, 96, 96), (long + 37, 96, 96)]:  # fmt: skip
        a = torch.randn(m, k, generator=gen).to(dtype)
        w = torch.randn(n, k, generator=gen).to(dtype)
        seen = _tile_lengths(monkeypatch)
        ours = gemm.mm_blocks(a, w.t())
        assert torch.equal(_bits(ours), _bits(_reference(a, w.t())))
        rest = m % long if m >= long and gemm.tiles_agree(w.t(), long) else m
        height = gemm.fitted_rows(rest)
        fitted = height != tiles.ROW_TILE and gemm.tiles_agree(w.t(), height)
        assert seen[-1] == (height if fitted else tiles.ROW_TILE)


def test_fitted_tiles_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gemm, "FITTED_TILES", False)
    a, w = torch.randn(gemm.LONG_ROW_TILE - 1, 64), torch.randn(32, 64)
    seen = _tile_lengths(monkeypatch)
    assert torch.equal(gemm.mm_blocks(a, w.t()), _reference(a, w.t()))
    assert seen == [tiles.ROW_TILE]


def test_a_blas_whose_long_tiles_differ_keeps_short_ones(
    threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A BLAS whose long products round otherwise (here: every long tile's result nudged by
    one ulp) is caught by the check, and every product keeps 16-row tiles and their bits."""
    long = gemm.LONG_ROW_TILE
    real_mm = torch.mm

    def nudged(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None):
        result = real_mm(a, b, out=out)
        if a.shape[0] == long:
            result.copy_(torch.nextafter(result, torch.full_like(result, float("inf"))))
        return result

    monkeypatch.setattr(torch, "mm", nudged)
    monkeypatch.setattr(gemm, "_agreement", {})
    gen = torch.Generator().manual_seed(threads)
    a, w = torch.randn(long + 40, 96, generator=gen), torch.randn(64, 96, generator=gen)
    assert not gemm.tiles_agree(w.t(), long)
    seen = _tile_lengths(monkeypatch)
    assert torch.equal(gemm.mm_blocks(a, w.t()), _reference(a, w.t()))
    assert seen == [tiles.ROW_TILE]
    # a decode step's 100 rows would take one 112-row tile: another height, checked apart
    assert gemm.tiles_agree(w.t(), gemm.fitted_rows(100))
    seen.clear()
    assert torch.equal(gemm.mm_blocks(a[:100], w.t()), _reference(a[:100], w.t()))
    assert seen == [gemm.fitted_rows(100)]


def test_a_blas_whose_fitted_tiles_differ_keeps_short_ones(
    threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A BLAS whose 4-row products round otherwise (simulated: nudged by one ulp) is caught
    by the check of that height: a one-sequence decode step keeps a 16-row tile and its
    bits, while 8-row tiles, checked apart, are still taken."""
    real_mm = torch.mm

    def nudged(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None):
        result = real_mm(a, b, out=out)
        if a.shape[0] == 4:
            result.copy_(torch.nextafter(result, torch.full_like(result, float("inf"))))
        return result

    monkeypatch.setattr(torch, "mm", nudged)
    monkeypatch.setattr(gemm, "_agreement", {})
    gen = torch.Generator().manual_seed(threads)
    a, w = torch.randn(8, 96, generator=gen), torch.randn(64, 96, generator=gen)
    assert not gemm.tiles_agree(w.t(), 4) and gemm.tiles_agree(w.t(), 8)
    seen = _tile_lengths(monkeypatch)
    assert torch.equal(gemm.mm_blocks(a[:1], w.t()), _reference(a[:1], w.t()))
    assert torch.equal(gemm.mm_blocks(a[:6], w.t()), _reference(a[:6], w.t()))
    assert seen == [tiles.ROW_TILE, 8]


def test_the_check_tries_one_column_tile_of_each_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    """Column tiles of one width and start alignment run one instruction sequence: a wide
    head is checked on one of them, and a tile of another kind (here the narrower last
    one, rounded otherwise in 4-row products) is still checked and caught."""
    head = torch.randn(49152, 64).t()  # F.linear's transposed weight: every tile one kind
    assert len(gemm._column_classes(head)) == 1
    w = torch.randn(520, 64)  # cut 272 + 248: two kinds
    last = tiles.cuts(520, tiles.COL_TILE, w.dtype)[-1]
    assert [p.shape[1] for p in gemm._column_classes(w.t())] == [272, last[1] - last[0]]
    real_mm = torch.mm

    def nudged(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None):
        result = real_mm(a, b, out=out)
        if a.shape[0] == 4 and b.shape[1] == last[1] - last[0]:
            result.copy_(torch.nextafter(result, torch.full_like(result, float("inf"))))
        return result

    monkeypatch.setattr(torch, "mm", nudged)
    monkeypatch.setattr(gemm, "_agreement", {})
    assert not gemm.tiles_agree(w.t(), 4) and gemm.tiles_agree(w.t(), 8)


def test_the_check_is_per_layout_and_skips_broadcast_weights(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(gemm, "_agreement", {})
    w = torch.randn(64, 96)
    long = gemm.LONG_ROW_TILE
    gemm.tiles_agree(w.t(), long)  # F.linear's transposed weight
    gemm.tiles_agree(w.t().contiguous(), long)  # a row-major one
    gemm.tiles_agree(torch.randn(64, 96)[:, 1:65], long)  # a slice off the 64-byte grid
    assert len(gemm._agreement) == 3
    gemm.tiles_agree(w.t(), 4)  # another height: checked apart
    assert len(gemm._agreement) == 4
    row = torch.randn(96, 1)
    assert not gemm.tiles_agree(row.expand(96, 40), long)  # a zero stride: not tried
    assert not gemm.tiles_agree(torch.randn(0, 40), long)  # nothing to multiply
    assert len(gemm._agreement) == 4
    k0 = gemm.mm_blocks(torch.randn(gemm.LONG_ROW_TILE, 0), torch.randn(0, 40))
    assert k0.shape == (gemm.LONG_ROW_TILE, 40) and not k0.any()
