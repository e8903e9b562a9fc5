"""Batch-invariant matrix multiplication.

On the CPU every product is computed tile by tile by `tiles` (fixed row, column and K
tiles, single-threaded fixed-shape partial products added in K-tile order, threads sharing
output tiles only), so a row's bits depend on neither the batch, nor the row's position,
nor the thread count, nor the BLAS's choices. On CUDA one fixed Triton tile configuration.

The tiles are computed with the `out=` overloads of torch's GEMMs, which are separate
operators from the ones `batch_invariant()` overrides, so there is no recursion.
"""

from __future__ import annotations

import torch

from tandem.moe_determinism.errors import MoEDeterminismError
from tandem.moe_determinism.ops import tiles, workers


def cuda_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    from tandem.moe_determinism.kernels.dispatch import cuda_mm as kernel

    return kernel(a, b)


def cuda_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    from tandem.moe_determinism.kernels.dispatch import cuda_bmm as kernel

    return kernel(a, b)


def _check(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if a.shape[-1] != b.shape[-2]:
        raise MoEDeterminismError(
            f"{what}: inner dimensions differ ({tuple(a.shape)} @ {tuple(b.shape)}); "
            "the last dim of the first operand must equal the second-to-last of the second"
        )
    if a.dtype != b.dtype:
        raise MoEDeterminismError(
            f"{what}: dtypes differ ({a.dtype} vs {b.dtype}); cast one operand first"
        )


class _BlockedProduct(torch.autograd.Function):
    """Autograd for the blocked GEMMs (the `out=` kernels they use do not record a graph).

    Only the forward pass has to be invariant; gradients use torch's products."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(a, b)
        if a.is_cuda:
            return cuda_bmm(a, b) if a.dim() == 3 else cuda_mm(a, b)
        return bmm_blocks(a, b) if a.dim() == 3 else mm_blocks(a, b)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # type: ignore[override]
        a, b = ctx.saved_tensors
        ga = grad @ b.transpose(-1, -2) if ctx.needs_input_grad[0] else None
        gb = a.transpose(-1, -2) @ grad if ctx.needs_input_grad[1] else None
        return ga, gb


def needs_graph(*tensors: torch.Tensor) -> bool:
    """Whether autograd would record an op on ``tensors`` here."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def fixed_shape_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[P, R, K] @ [P, K, N] for operands whose per-matrix shape the caller keeps fixed.

    On the CPU each matrix is a tile of `tiles` (no extra row padding), computed in batched
    calls of exactly `tiles.BATCH` items: its bits do not depend on P, on its place among
    the P, or on the thread count. Supports autograd."""
    if needs_graph(a, b):
        return _FixedBmm.apply(a, b)
    return _fixed_bmm(a, b)


def _fixed_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = torch.empty(a.shape[0], a.shape[1], b.shape[2], dtype=a.dtype, device=a.device)
    if a.is_cuda:
        return torch.bmm(a, b, out=out)
    jobs = tiles.tile_jobs(a, b, out, batched=True)
    workers.run_parallel(jobs, a.numel() * b.shape[2])
    return out


def fixed_shape_bmm_indexed(
    a: torch.Tensor, source: torch.Tensor, index: torch.Tensor, *, transposed: bool = False
) -> torch.Tensor:
    """`fixed_shape_bmm(a, b)` with b[p] = source[index[p]] (transposed: its transpose),
    without the copy of every item's right operand: on the CPU, items that read one block
    (``index`` sorted puts them together) multiply it in place, with the bits of the
    gathered batch (`tiles.indexed_jobs`). No autograd graph: for inference and forwards
    whose gradient comes from elsewhere."""
    cols = source.shape[1] if transposed else source.shape[2]
    if a.is_cuda or a.shape[0] < tiles.BATCH or a.shape[2] > tiles.K_TILE:
        b = source.index_select(0, index)
        return _fixed_bmm(a, b.transpose(1, 2) if transposed else b)
    out = torch.empty(a.shape[0], a.shape[1], cols, dtype=a.dtype, device=a.device)
    jobs = tiles.indexed_jobs(a, source, index, out, transposed)
    workers.run_parallel(jobs, a.numel() * cols)
    return out


class _FixedBmm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(a, b)
        return _fixed_bmm(a, b)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # type: ignore[override]
        a, b = ctx.saved_tensors
        ga = torch.bmm(grad, b.transpose(1, 2)) if ctx.needs_input_grad[0] else None
        gb = torch.bmm(a.transpose(1, 2), grad) if ctx.needs_input_grad[1] else None
        return ga, gb


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[G, M, K] @ [G, K, N] with each row's reduction order independent of M."""
    if a.dim() != 3 or b.dim() != 3:
        raise MoEDeterminismError(f"bmm expects 3-D operands, got {a.dim()}-D and {b.dim()}-D")
    _check(a, b, "bmm")
    if needs_graph(a, b):
        return _BlockedProduct.apply(a, b)
    if a.is_cuda:
        return cuda_bmm(a, b)
    return bmm_blocks(a, b)


def bmm_blocks(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The CPU kernel of `bmm` (no autograd graph): row tiles of every matrix, as in `mm`."""
    g, m, _ = a.shape
    n = b.shape[-1]
    padded = tiles.row_tiles(a)  # [G, tiles, R, K]
    blocks, r = padded.shape[1], padded.shape[2]
    out = torch.empty(g, blocks, r, n, dtype=a.dtype, device=a.device)
    jobs = []
    if g <= blocks:  # few matrices of many rows (MoE experts): per matrix, its row tiles
        for i in range(g):
            jobs += tiles.tile_jobs(padded[i], b[i].expand(blocks, *b.shape[1:]), out[i])
    else:  # many matrices of few rows: per row tile, every matrix
        for i in range(blocks):
            jobs += tiles.tile_jobs(padded[:, i], b, out[:, i])
    workers.run_parallel(jobs, padded.numel() * n)
    return out.view(g, blocks * r, n)[:, :m]


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[M, K] @ [K, N], row-invariant."""
    if a.dim() != 2 or b.dim() != 2:
        raise MoEDeterminismError(f"mm expects 2-D operands, got {a.dim()}-D and {b.dim()}-D")
    _check(a, b, "mm")
    if needs_graph(a, b):
        return _BlockedProduct.apply(a, b)
    if a.is_cuda:
        return cuda_mm(a, b)
    return mm_blocks(a, b)


def mm_blocks(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The CPU kernel of `mm` (no autograd graph): row tiles against the weight broadcast
    along the tiles (a stride-0 view, never copied). Products of at least `LONG_ROW_TILE`
    rows take tiles of that many, and the rows after the last long tile (or a product of
    fewer rows: a decode step's) one tile of their own count rounded up (`fitted_rows`),
    each where `tiles_agree` (a row's bits are those of `tiles.ROW_TILE`-row tiles);
    otherwise `tiles.ROW_TILE` rows at a time."""
    m, n = a.shape[0], b.shape[1]
    if m == 0:
        return a.new_empty(0, n)
    long = LONG_ROW_TILE if 0 < LONG_ROW_TILE <= m and tiles_agree(b, LONG_ROW_TILE) else 0
    rest = m - (m // long * long if long else 0)
    most = max(LONG_ROW_TILE, tiles.ROW_TILE)  # more rows than a long tile: 16 at a time
    last = fitted_rows(rest) if FITTED_TILES and 0 < rest <= most else 0
    if last == tiles.ROW_TILE or (last and not tiles_agree(b, last)):
        last = 0
    return _mm_in_tiles(a, b, long, last)


LONG_ROW_TILE = 128
"""Rows per tile of long products (a prefill, a trainer's forward), 0 for none. A BLAS
runs a 16-row product well below its large-product speed: SmolLM2-135M's layer products
over 3,000 rows took 1.2-1.4x as long in 16-row tiles as with these (one thread,
`benchmarks/long_tiles.py`, "16-row" against today; an ad-hoc comparison found 256 rows no
faster, and 128 reaches a GRPO group's 192 sampled rows). Tiles of both lengths must give a
row the same bits, or the engine (decoding a few rows at a time) and the trainer would
disagree: each weight layout is checked once per process (`tiles_agree`), and where
the bits differ every product keeps `tiles.ROW_TILE`."""

FITTED_TILES = True
"""Whether the rows after the long tiles (all the rows of a decode step) take one tile of
`fitted_rows` rows where `tiles_agree`, instead of `tiles.ROW_TILE` at a time. A decode
step of 32 sequences then reads each weight once, not once per 16 rows, and one sequence
multiplies 4 rows, not 16 (`benchmarks/fitted_tiles.py`)."""


def fitted_rows(m: int) -> int:
    """The height of one tile holding ``m`` rows: 4 or 8 for a few rows, else ``m`` rounded
    up to whole `tiles.ROW_TILE`s (few heights, so few layouts to check)."""
    if m <= 8:
        return 4 if m <= 4 else 8
    return -(-m // tiles.ROW_TILE) * tiles.ROW_TILE


_agreement: dict[tuple, bool] = {}  # a property of this machine's BLAS per layout and height
CHECK_ROWS = 128
"""Random rows per agreement check (in tiles of the height checked)."""


def tiles_agree(b: torch.Tensor, rows: int) -> bool:
    """Whether rows multiplied by ``b`` [K, N] in ``rows``-row tiles get the bits of
    `tiles.ROW_TILE`-row tiles, tried once on random values laid out as ``b`` (shape,
    strides and address modulo `tiles.ALIGN_BYTES`: what chooses the BLAS's kernel).

    A single-threaded product of one shape and layout runs one instruction sequence, so
    equal bits on random rows (random terms summed in another order differ somewhere in
    `CHECK_ROWS` x N results) mean the same order for every input. Empty weights and
    layouts with a zero stride are not tried (`tiles.ROW_TILE`-row tiles)."""
    if b.numel() == 0 or any(s <= 0 for s, n in zip(b.stride(), b.shape, strict=True) if n > 1):
        return False
    per = b.element_size()
    offset = b.data_ptr() % tiles.ALIGN_BYTES // per
    key = (tuple(b.shape), b.stride(), offset, b.dtype, rows)
    if key not in _agreement:
        gen = torch.Generator().manual_seed(0)
        span = 1 + sum((size - 1) * s for size, s in zip(b.shape, b.stride(), strict=True))
        flat = torch.empty(offset + span, dtype=b.dtype)  # 64-byte aligned base
        parts = _column_classes(flat.as_strided(b.shape, b.stride(), offset))
        for part in parts:  # only the tiles checked are read
            part.copy_(torch.randn(part.shape, generator=gen).to(b.dtype))
        count = -(-CHECK_ROWS // rows) * rows
        a = torch.randn(count, b.shape[0], generator=gen).to(b.dtype)
        _agreement[key] = all(
            torch.equal(_mm_in_tiles(a, part, rows, 0), _mm_in_tiles(a, part, 0, 0))
            for part in parts
        )
    return _agreement[key]


def _column_classes(b: torch.Tensor) -> list[torch.Tensor]:
    """One column tile of ``b`` per kind the products call the BLAS with: width and start
    address modulo `tiles.ALIGN_BYTES` (the layout is ``b``'s). Tiles of one kind run one
    instruction sequence, so checking one of each checks all: a 49,152-column head has one
    kind, where multiplying it whole took 0.5-0.7 s per check on one thread (AMD EPYC)."""
    kinds: dict[tuple[int, int], torch.Tensor] = {}
    for c0, c1 in tiles.cuts(b.shape[1], tiles.COL_TILE, b.dtype):
        start = (b.storage_offset() + c0 * b.stride(1)) * b.element_size() % tiles.ALIGN_BYTES
        kinds.setdefault((c1 - c0, start), b[:, c0:c1])
    return list(kinds.values())


def _mm_in_tiles(a: torch.Tensor, b: torch.Tensor, long: int, last: int) -> torch.Tensor:
    """a @ b by `tiles`: the first rows in tiles of ``long`` (0: none), the rest in tiles of
    ``last`` rows (0: `tiles.ROW_TILE`), the last one zero-padded; all the tiles' jobs
    shared by the threads at once."""
    m, k = a.shape
    n = b.shape[1]
    head = m // long * long if long else 0
    last = last or tiles.ROW_TILE
    rest = -(-(m - head) // last) * last
    out = torch.empty(head + rest, n, dtype=a.dtype, device=a.device)
    parts = []
    if head:
        parts.append((tiles.row_tiles(a[:head], long), out[:head].view(head // long, long, n)))
    if rest:
        parts.append((tiles.row_tiles(a[head:], last), out[head:].view(-1, last, n)))
    work = (head + rest) * k * n
    jobs = []
    for padded, dst in parts:
        if tiles.one_tile(k, n, a.element_size()) and (
            workers.tile_threads() == 1 or work < workers.SHARED_WORK
        ):
            jobs.append(tiles.shared_weight_job(padded, b, dst))
        else:
            jobs += tiles.tile_jobs(padded, b.expand(padded.shape[0], k, n), dst)
    workers.run_parallel(jobs, work)
    return out[:m]


def addmm(
    bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float = 1.0, alpha: float = 1.0
) -> torch.Tensor:
    """beta * bias + alpha * (a @ b); the element-wise epilogue is invariant by construction."""
    prod = mm(a, b)
    if alpha != 1:
        prod = prod * alpha
    if beta == 0:
        return prod
    return prod + (bias if beta == 1 else bias * beta)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`torch.matmul` semantics for the cases models use: [..., M, K] @ [K, N] or batched."""
    if b.dim() == 2:
        lead = a.shape[:-1]
        return mm(a.reshape(-1, a.shape[-1]), b).reshape(*lead, b.shape[-1])
    if a.dim() < 3 or b.dim() < 3:
        raise MoEDeterminismError(
            f"matmul supports [..., M, K] @ [K, N] and batched 3-D+ operands; got "
            f"{tuple(a.shape)} @ {tuple(b.shape)}"
        )
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a3 = a.expand(*batch, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
    b3 = b.expand(*batch, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
    return bmm(a3, b3).reshape(*batch, a.shape[-2], b.shape[-1])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias, row-invariant over every leading dim of x."""
    out = matmul(x, weight.t())
    return out + bias if bias is not None else out
