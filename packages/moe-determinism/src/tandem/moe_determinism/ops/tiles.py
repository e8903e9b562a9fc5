"""Tile products on the CPU with a reduction order of our own, whatever the BLAS or threads.

A BLAS chooses, from the problem shape and the number of threads, how it cuts a product
and in which order it adds each output element's terms: MKL gives row i of `A[:m] @ B`
other bits than row i of `A @ B` for small m, and with 2 threads it may split the reduced
dimension between them. So no product here is ever handed to the BLAS as it comes:

1. Rows are cut into tiles of exactly `ROW_TILE` rows (the last one zero-padded; long
   products into longer tiles, and short ones into one tile of their own rows rounded up,
   where the BLAS gives a row the same bits: `gemm.LONG_ROW_TILE`, `gemm.fitted_rows`),
   columns into even pieces of at most `COL_TILE` and the reduced dimension K into even
   pieces of at most `K_TILE` (`cuts`); every column and K cut
   depends on K and N (properties of the weight) and never on M or the thread count.
2. Each (row tile, column tile, K tile) partial product is one call of one fixed shape and
   layout, run by a thread whose OpenMP and BLAS thread count is 1. A single-threaded call
   of a fixed shape runs one fixed instruction sequence, and output element (i, j) of a tile
   reads only row i of A and column j of B, so a row's partial does not depend on the other
   rows, on M, or on how many threads there are: the BLAS never sees a shape or a thread
   count that varies with the batch.
3. The partials of one output tile are added in K-tile order (0, 1, 2, ...), element-wise:
   that order is ours, fixed by K alone.
4. Parallelism is over output tiles only: `workers.tile_threads()` single-threaded workers
   share the tiles, each tile wholly computed by one of them, so the thread count changes
   who computes a tile, never how.

Products against one shared weight (`mm`, `bmm`) are one `torch.mm(..., out=)` call per
tile. Products whose every item is its own pair of operands (`fixed_shape_bmm`: attention's
query-block x KV-split pairs, thousands per prefill and a hundred per decode step) run as
batched calls of exactly `BATCH` items: torch's batched product calls the BLAS's batched
entry point for several matrices and its plain GEMM for one, whose bits differ (MKL, one
thread, [16, 1000] @ [1000, 1]), so a batch never has another count. A short batch is
padded with zero items (copies laid out like the items), a long one is cut into windows of
`BATCH` (the last overlapping the one before). An item's bits there must not depend on its
place in the batch nor on the other items: tested for every layout used.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from tandem.moe_determinism.ops import workers

ROW_TILE = 16
"""Rows per tile: the height whose bits every other height must give (`gemm.tiles_agree`).
Long products take tiles of `gemm.LONG_ROW_TILE` and short ones (a decode step's) one tile
of `gemm.fitted_rows` where the BLAS agrees."""

COL_TILE = 512
"""Most output columns per tile (`cuts`: 576 are two of 288): what lets a decode step (one
row tile) use several threads."""

K_TILE = 2048
"""Most terms per partial product (`cuts`); partials are added in tile order, K <= K_TILE is
one tile. A BLAS sums a long K at its own speed; each extra piece costs a call, an add and
a rounding: with 512 and cuts from the left, SmolLM2-135M's 576 terms were a 512 and a 64
product, and its layer products took 1.06-1.14x as long over 3,000 rows (one thread) and
1.4-1.7x over 32 (two threads: a decode step's), `benchmarks/long_tiles.py`, "before"
against "16-row", default kernels."""


BATCH = 16
"""Items per batched call of `fixed_shape_bmm`'s products: one call's overhead is spread
over 16 small items (about 2.5x fewer microseconds than one call per item)."""


def _split(count: int, parts: int, step_multiple: int = 1) -> list[tuple[int, int]]:
    step = max(1, math.ceil(count / max(parts, 1)))
    step = -(-step // step_multiple) * step_multiple
    return [(lo, min(lo + step, count)) for lo in range(0, count, step)]


def cuts(count: int, most: int, dtype: torch.dtype) -> list[tuple[int, int]]:
    """[0, count) in the fewest pieces of at most ``most``, all as wide as the first but
    the last, that width a whole number of `ALIGN_BYTES` of ``dtype`` (so every piece of an
    aligned row starts aligned): 576 columns are 288 + 288, not 512 + 64, whose narrow
    product costs almost as much as the wide one. A function of ``count`` alone."""
    if count <= 0:
        return []
    pieces = -(-count // most)
    per = max(1, ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())
    even = -(-count // pieces)
    width = -(-even // per) * per
    return [(lo, min(lo + width, count)) for lo in range(0, count, width)]


def _row_width(cols: int, dtype: torch.dtype) -> int:
    """``cols`` rounded up to a whole number of `ALIGN_BYTES`: the row stride of an aligned
    buffer (`pad_rows`, `aligned_zeros`)."""
    per_row = max(1, ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())
    return -(-cols // per_row) * per_row


def _aligned_empty(p: int, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """A fresh [p, rows, cols] whose rows start on `ALIGN_BYTES` boundaries."""
    return torch.empty(p, rows, _row_width(cols, dtype), dtype=dtype)[..., :cols]


def _one_by_one(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out[p] = a[p] @ b[p] as one `torch.mm` per item (b a shared weight: stride-0 items)."""
    if b.stride(0) == 0:
        rhs = b[0]
        for lhs, dst in zip(a.unbind(0), out.unbind(0), strict=True):
            torch.mm(lhs, rhs, out=dst)
    else:
        for lhs, rhs, dst in zip(a.unbind(0), b.unbind(0), out.unbind(0), strict=True):
            torch.mm(lhs, rhs, out=dst)


def _staged(t: torch.Tensor, count: int) -> torch.Tensor:
    """`t`'s items then zero items, `count` in all, each laid out as in `t` (aligned rows,
    or aligned columns for a transposed operand)."""
    if t.stride(0) == 0:
        return t[:1].expand(count, *t.shape[1:])
    columns = t.stride(-1) != 1
    u = t.transpose(1, 2) if columns else t
    staged = _aligned_empty(count, u.shape[1], u.shape[2], t.dtype)
    staged[: t.shape[0]] = u
    staged[t.shape[0] :] = 0
    return staged.transpose(1, 2) if columns else staged


def _batched(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out[p] = a[p] @ b[p] as `torch.bmm` calls of exactly `BATCH` items."""
    p = a.shape[0]
    if p < BATCH:
        staged = _aligned_empty(BATCH, a.shape[1], b.shape[2], a.dtype)
        torch.bmm(_staged(a, BATCH), _staged(b, BATCH), out=staged)
        out.copy_(staged[:p])
        return
    for lo in range(0, p, BATCH):
        lo = min(lo, p - BATCH)  # the last window overlaps the one before: same bits again
        torch.bmm(a[lo : lo + BATCH], b[lo : lo + BATCH], out=out[lo : lo + BATCH])


def _tile_job(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    items: tuple[int, int],
    cols: tuple[int, int],
    products: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None],
) -> Callable[[], None]:
    """The job computing out[items, :, cols] = a[items] @ b[items][:, :, cols], K tile by K
    tile, the partials added in K-tile order. A partial goes straight into the output when
    its rows are aligned and no wider accumulator is needed; else into an aligned buffer."""

    def job() -> None:
        (lo, hi), (c0, c1) = items, cols
        dst = out[lo:hi, :, c0:c1]
        k = a.shape[2]
        lhs, rhs = a[lo:hi], b[lo:hi, :, c0:c1]
        if 0 < k <= K_TILE and _aligned(dst):  # one K tile, straight into the output
            products(lhs, rhs, dst)
            return
        if k == 0:
            dst.zero_()
            return
        wide = torch.promote_types(a.dtype, torch.float32)
        direct = wide == a.dtype and _aligned(dst)
        acc: torch.Tensor | None = None
        for k0, k1 in cuts(k, K_TILE, a.dtype):
            if acc is None and direct:
                part = dst
            else:
                part = _aligned_empty(hi - lo, a.shape[1], c1 - c0, a.dtype)
            products(lhs[:, :, k0:k1], rhs[:, k0:k1], part)
            if acc is None:
                acc = part if k1 == k else part.to(wide)
            else:
                acc.add_(part)  # partials in K-tile order
        if acc is not dst:
            dst.copy_(acc)  # type: ignore[arg-type]

    return job


def shared_weight_job(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> Callable[[], None]:
    """One job for out[t] = a[t] @ b, every row tile t, when K and N are one tile each and
    `out` [T, R, N] is a fresh buffer with aligned rows: the calls `tile_jobs` would make,
    without its bookkeeping (a decode step's small products are mostly that). `a` comes
    from `row_tiles` (aligned rows)."""
    a, b = a.detach(), b.detach()

    def job() -> None:
        for lhs, dst in zip(a.unbind(0), out.unbind(0), strict=True):
            torch.mm(lhs, b, out=dst)

    return job


def one_tile(k: int, n: int, element_size: int) -> bool:
    """K and N each fit one tile, and a fresh [.., N] output has aligned rows."""
    return 0 < k <= K_TILE and 0 < n <= COL_TILE and (n * element_size) % ALIGN_BYTES == 0


def tile_jobs(
    a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, *, batched: bool = False
) -> list[Callable[[], None]]:
    """Jobs for out[p] = a[p] @ b[p]; a [P, ROW_TILE or any fixed rows, K], b [P, K, N]
    (a stride-0 expand for a shared weight), out [P, rows, N]. Jobs cover whole tiles:
    consecutive items of one column tile, about twice `workers.tile_threads()` jobs in all.
    `batched`: each item its own operands, computed `BATCH` at a time."""
    # workers run without the caller's below-autograd state; rows aligned (`ALIGN_BYTES`)
    a, b = aligned_rows(a.detach()), b.detach()
    if batched:
        b = aligned_items(b)
    items, n = a.shape[0], b.shape[2]
    col_tiles = cuts(n, COL_TILE, a.dtype)
    threads = workers.tile_threads()
    parts = 1 if threads == 1 else max(1, math.ceil(2 * threads / max(1, len(col_tiles))))
    products = _batched if batched else _one_by_one
    ranges = _split(items, parts, BATCH if batched else 1)
    return [_tile_job(a, b, out, rng, cols, products) for cols in col_tiles for rng in ranges]


def indexed_jobs(
    a: torch.Tensor, source: torch.Tensor, index: torch.Tensor, out: torch.Tensor, transposed: bool
) -> list[Callable[[], None]]:
    """Jobs for out[p] = a[p] @ B[p], B[p] = source[index[p]] (its transpose with
    ``transposed``): `tile_jobs(batched=True)`'s products, exactly `BATCH` items per call in
    the same windows, without gathering every item's right operand first. A window whose
    items all read one block multiplies a stride-0 view of that block (copied once when its
    rows are not aligned); any other window gathers its own `BATCH` blocks. Each item's operands and their layouts are those of the
    gathered batch (`aligned_items`), so its bits are too. Needs at least `BATCH` items and
    a reduced dimension of one K tile."""
    a, source = aligned_rows(a.detach()), source.detach()
    p = a.shape[0]
    starts = list(range(0, p - BATCH + 1, BATCH))
    if p % BATCH:
        starts.append(p - BATCH)  # the last window overlaps the one before, as in `_batched`
    windows = index[torch.tensor(starts)[:, None] + torch.arange(BATCH)[None, :]]
    one_block = (windows == windows[:, :1]).all(1).tolist()
    first = windows[:, 0].tolist()
    direct = _aligned(out)

    def operand(w: int) -> torch.Tensor:
        one = one_block[w]
        blocks = source[first[w] : first[w] + 1] if one else gather_aligned(source, windows[w])
        blocks = aligned_items(blocks.transpose(1, 2) if transposed else blocks)
        return blocks.expand(BATCH, *blocks.shape[1:]) if one else blocks  # aligned once

    def job(ws: range) -> Callable[[], None]:
        def run() -> None:
            for w in ws:
                lo = starts[w]
                if direct:
                    torch.bmm(a[lo : lo + BATCH], operand(w), out=out[lo : lo + BATCH])
                    continue
                part = _aligned_empty(BATCH, a.shape[1], out.shape[2], a.dtype)
                torch.bmm(a[lo : lo + BATCH], operand(w), out=part)
                out[lo : lo + BATCH] = part

        return run

    threads = workers.tile_threads()
    ranges = _split(len(starts), 1 if threads == 1 else 2 * threads)
    if len(ranges) > 1 and ranges[-1][1] - ranges[-1][0] == 1 and p % BATCH:
        ranges[-2:] = [(ranges[-2][0], ranges[-1][1])]  # overlapping windows: one thread
    return [job(range(lo, hi)) for lo, hi in ranges]


ALIGN_BYTES = 64
"""Every row of a tile starts on a 64-byte boundary. Some kernels peel an unaligned head off
a row before their vector loop, so a row's sum order would follow its address: with MKL,
fp32, K = 511 and N <= 11, the rows at positions 1-3 of every 4 in a tile come out different
from the same row at position 0."""


def _aligned(t: torch.Tensor) -> bool:
    size, strides = t.element_size(), t.stride()
    return (
        strides[-1] == 1
        and t.data_ptr() % ALIGN_BYTES == 0
        and all((s * size) % ALIGN_BYTES == 0 for s in strides[:-1])
    )


def pad_rows(a: torch.Tensor, rows: int = ROW_TILE) -> torch.Tensor:
    """[..., M, K] -> [..., tiles, rows, K], the last tile zero-padded, every row aligned.

    Always a fresh buffer whose rows are `ALIGN_BYTES`-aligned (its row stride K rounded
    up): every tile has the same layout whatever the caller's strides were."""
    m, k = a.shape[-2], a.shape[-1]
    tiles = -(-m // rows)
    width = _row_width(k, a.dtype)
    padded = a.new_zeros(*a.shape[:-2], tiles * rows, width)
    padded[..., :m, :k] = a
    return padded.view(*a.shape[:-2], tiles, rows, width)[..., :k]


def row_tiles(a: torch.Tensor, rows: int = ROW_TILE) -> torch.Tensor:
    """[..., M, K] -> [..., tiles, rows, K]: a view of `a` itself when its rows are
    aligned and fill whole tiles (a decode batch of 16, experts' rows allocated in whole
    tiles), else `pad_rows`' fresh copy."""
    m = a.shape[-2]
    if m % rows == 0 and _aligned(a):
        return a.unflatten(-2, (m // rows, rows))
    return pad_rows(a, rows)


def aligned_zeros(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Zeros of ``shape`` whose rows (last dim) start on `ALIGN_BYTES` boundaries: a view of
    a buffer with the row stride rounded up, laid out as `pad_rows` lays out its copies. A
    KV cache allocated so is read by the split attention's products in place, where rows of
    another width would be copied out first, block by block, every step."""
    width = _row_width(shape[-1], dtype)
    return torch.zeros(*shape[:-1], width, dtype=dtype, device=device)[..., : shape[-1]]


def gather_aligned(source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``source.index_select(0, index)`` with aligned rows, in one copy when ``source`` is
    a view of an `aligned_zeros` buffer (a KV cache): the gather then takes the buffer's
    whole rows, padding columns included (zeros, as `pad_rows` would write), so the products
    read the result in place instead of copying it again."""
    width = _row_width(source.shape[-1], source.dtype)
    if source.dim() < 2 or source.stride(-1) != 1 or source.stride(-2) != width:
        return source.index_select(0, index)
    shape = (*source.shape[:-1], width)
    strides = source.stride()
    last = source.storage_offset() + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
    if 0 in shape or (last + 1) * source.element_size() > source.untyped_storage().nbytes():
        return source.index_select(0, index)  # the padding columns are not all there
    wide = source.as_strided(shape, source.stride())
    return wide.index_select(0, index)[..., : source.shape[-1]]


def aligned_rows(a: torch.Tensor) -> torch.Tensor:
    """`a` itself if its rows are `ALIGN_BYTES`-aligned, else an aligned copy."""
    return a if _aligned(a) else pad_rows(a, a.shape[-2]).squeeze(-3)


def aligned_items(b: torch.Tensor) -> torch.Tensor:
    """`b` [P, K, N] itself if its rows, or for a transposed operand its columns, are
    `ALIGN_BYTES`-aligned; else an aligned copy laid out the same way."""
    if b.stride(-1) != 1 and b.stride(-2) == 1:
        return aligned_rows(b.transpose(-1, -2)).transpose(-1, -2)
    return aligned_rows(b)
