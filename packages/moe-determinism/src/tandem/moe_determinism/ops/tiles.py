"""Tile products on the CPU with a reduction order of our own, whatever the BLAS or threads.

A BLAS chooses, from the problem shape and the number of threads, how it cuts a product
and in which order it adds each output element's terms: MKL gives row i of `A[:m] @ B`
other bits than row i of `A @ B` for small m, and with 2 threads it may split the reduced
dimension between them. So no product here is ever handed to the BLAS as it comes:

1. Rows are cut into tiles of exactly `ROW_TILE` rows (the last one zero-padded), columns
   into tiles of `COL_TILE` and the reduced dimension K into tiles of `K_TILE`; every cut
   depends on K and N (properties of the weight) and never on M or the thread count.
2. Each (row tile, column tile, K tile) partial product is one call of one fixed shape and
   layout, run by a thread whose OpenMP and BLAS thread count is 1. A single-threaded call
   of a fixed shape runs one fixed instruction sequence, and output element (i, j) of a tile
   reads only row i of A and column j of B, so a row's partial does not depend on the other
   rows, on M, or on how many threads there are: the BLAS never sees a shape or a thread
   count that varies with the batch.
3. The partials of one output tile are added in K-tile order (0, 1, 2, ...), element-wise:
   that order is ours, fixed by K alone.
4. Parallelism is over output tiles only: `torch.get_num_threads()` single-threaded workers
   share the tiles, each tile wholly computed by one of them, so the thread count changes
   who computes a tile, never how.

Each partial product is its own `torch.mm(..., out=)` call: torch's batched product calls
the BLAS's batched entry point for several matrices and its plain GEMM for one, whose bits
differ (MKL, one thread, [16, 1000] @ [1000, 1]), so grouping tiles would let the batch in.
"""

from __future__ import annotations

import ctypes
import math
import queue
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

ROW_TILE = 16
"""Rows per tile. Small enough that a padded decode batch wastes little (small-M products
are bound by reading the weight), large enough that training-size products run near BLAS
speed."""

COL_TILE = 512
"""Output columns per tile: what lets a decode step (one row tile) use several threads."""

K_TILE = 512
"""Terms per partial product. Partials are added in tile order; K <= K_TILE is one tile."""


def _loaded_library(fragment: str) -> ctypes.CDLL | None:
    """A shared library this process has already loaded (by a fragment of its path)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if fragment in line and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


class _ThreadLocalCount:
    """Sets the calling thread's own OpenMP and MKL thread counts, nothing else.

    `torch.set_num_threads` would do it too, but also records the count for threads torch
    has not seen yet and clears oneDNN's primitive cache: process-wide effects, per call.
    Available where torch runs on an OpenMP runtime loaded as a shared library (GNU, LLVM or
    Intel); MKL is optional."""

    def __init__(self) -> None:
        self.omp = next(filter(None, map(_loaded_library, ("libgomp", "libomp", "libiomp"))), None)
        torch_cpu = _loaded_library("libtorch_cpu")
        # MKL's C entry point (the lower-case alias is the Fortran one, taking a pointer)
        self.mkl = getattr(torch_cpu, "MKL_Set_Num_Threads_Local", None) if torch_cpu else None

    @property
    def available(self) -> bool:
        return self.omp is not None

    @contextmanager
    def one(self) -> Iterator[None]:
        assert self.omp is not None
        before = self.omp.omp_get_max_threads()
        self.omp.omp_set_num_threads(1)
        mkl_before = self.mkl(1) if self.mkl is not None else 0
        try:
            yield
        finally:
            if self.mkl is not None:
                self.mkl(mkl_before)  # 0: back to MKL's process-wide count
            self.omp.omp_set_num_threads(before)


class _Workers:
    """Threads whose own OpenMP and BLAS thread count is 1, fed through one queue.

    `torch.set_num_threads` sets the calling thread's OpenMP and MKL counts (both are
    thread-local) and records the count that threads started later take; the creator
    writes its own count back afterwards, so nothing outside the workers changes."""

    def __init__(self, n: int) -> None:
        self.tasks: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        before = torch.get_num_threads()
        ready = threading.Barrier(n + 1)
        for i in range(n):
            threading.Thread(
                target=self._loop, args=(ready,), name=f"tile-worker-{i}", daemon=True
            ).start()
        ready.wait()
        torch.set_num_threads(before)

    def _loop(self, ready: threading.Barrier) -> None:
        torch.get_num_threads()  # torch's per-thread setup first: it would undo the 1 below
        torch.set_num_threads(1)
        ready.wait()
        while True:
            self.tasks.get()()

    def run(self, jobs: list[Callable[[], None]], caller: _ThreadLocalCount | None) -> None:
        """Run the jobs on the workers, and on the caller too when it can be made
        single-threaded; re-raise the first error once all have finished."""
        done = threading.Semaphore(0)
        errors: list[BaseException] = []
        pending: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()

        def take() -> None:  # one job, whichever is next
            try:
                pending.get_nowait()()
            except queue.Empty:
                return
            except BaseException as exc:  # handed back to the caller below
                errors.append(exc)
            done.release()

        for job in jobs:
            pending.put(job)
        for _ in jobs[1:] if caller is not None else jobs:
            self.tasks.put(take)
        if caller is not None:
            with caller.one():
                while not pending.empty():
                    take()
        for _ in jobs:
            done.acquire()
        if errors:
            raise errors[0]


_pools: dict[int, _Workers] = {}
_pools_lock = threading.Lock()
_caller = _ThreadLocalCount()


def _workers(n: int) -> _Workers:
    with _pools_lock:
        if n not in _pools:
            _pools[n] = _Workers(n)
        return _pools[n]


SHARED_WORK = 4_000_000
"""Multiply-adds below which the caller computes every tile itself: handing a few small
tiles to a worker costs more than it saves (and only moves who computes them)."""


def run_parallel(jobs: list[Callable[[], None]], work: int) -> None:
    """Run independent jobs (`work` multiply-adds in all), each wholly on one single-threaded
    thread: the caller (its own OpenMP/MKL count set to 1 meanwhile) and
    `torch.get_num_threads() - 1` workers.

    With one torch thread the caller is single-threaded already and runs them in turn."""
    threads = torch.get_num_threads()
    if threads == 1:  # also inside a worker: jobs never nest across threads
        for job in jobs:
            job()
        return
    if _caller.available:
        if len(jobs) == 1 or work < SHARED_WORK:
            with _caller.one():
                for job in jobs:
                    job()
            return
        _workers(threads - 1).run(jobs, _caller)
        return
    _workers(threads).run(jobs, None)


def _split(count: int, parts: int) -> list[tuple[int, int]]:
    step = max(1, math.ceil(count / max(parts, 1)))
    return [(lo, min(lo + step, count)) for lo in range(0, count, step)]


def _tile_products(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[P, R, k] @ [P, k, n] as P separate `torch.mm` calls of one shape, into a fresh
    [P, R, n] with aligned rows. Never one batched call: a BLAS's batched entry point may take
    another kernel for a batch of one than for several, so the batch would matter."""
    per_row = max(1, ALIGN_BYTES // a.element_size())
    width = -(-b.shape[2] // per_row) * per_row  # output rows aligned too (`ALIGN_BYTES`)
    out = torch.empty(a.shape[0], a.shape[1], width, dtype=a.dtype)[..., : b.shape[2]]
    if b.stride(0) == 0:  # one weight tile shared by every item
        rhs = b[0]
        for lhs, dst in zip(a.unbind(0), out.unbind(0), strict=True):
            torch.mm(lhs, rhs, out=dst)
    else:
        for lhs, rhs, dst in zip(a.unbind(0), b.unbind(0), out.unbind(0), strict=True):
            torch.mm(lhs, rhs, out=dst)
    return out


def _tile_job(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    items: tuple[int, int],
    cols: tuple[int, int],
) -> Callable[[], None]:
    """The job computing out[items, :, cols] = a[items] @ b[items][:, :, cols], K tile by K tile."""

    def job() -> None:
        lo, hi = items
        c0, c1 = cols
        k = a.shape[2]
        if k == 0:
            out[lo:hi, :, c0:c1].zero_()
            return
        acc: torch.Tensor | None = None
        for k0 in range(0, k, K_TILE):
            k1 = min(k0 + K_TILE, k)
            part = _tile_products(a[lo:hi, :, k0:k1], b[lo:hi, k0:k1, c0:c1])
            if acc is None:
                acc = part if k1 == k else part.to(torch.promote_types(part.dtype, torch.float32))
            else:
                acc.add_(part)  # partials in K-tile order
        out[lo:hi, :, c0:c1].copy_(acc)  # type: ignore[arg-type]

    return job


def tile_jobs(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> list[Callable[[], None]]:
    """Jobs for out[p] = a[p] @ b[p]; a [P, ROW_TILE or any fixed rows, K], b [P, K, N]
    (a stride-0 expand for a shared weight), out [P, rows, N]. Jobs cover whole tiles:
    consecutive items of one column tile, about `torch.get_num_threads()` jobs per tile."""
    # workers run without the caller's below-autograd state; rows aligned (`ALIGN_BYTES`)
    a, b = aligned_rows(a.detach()), b.detach()
    items, n = a.shape[0], b.shape[2]
    col_tiles = [(c, min(c + COL_TILE, n)) for c in range(0, n, COL_TILE)]
    threads = torch.get_num_threads()
    parts = 1 if threads == 1 else max(1, math.ceil(2 * threads / max(1, len(col_tiles))))
    return [_tile_job(a, b, out, rng, cols) for cols in col_tiles for rng in _split(items, parts)]


ALIGN_BYTES = 64
"""Every row of a tile starts on a 64-byte boundary. Some kernels peel an unaligned head off
a row before their vector loop, so a row's sum order would follow its address: with MKL,
fp32, K = 511 and N <= 11, the rows at positions 1-3 of every 4 in a tile come out different
from the same row at position 0."""


def _aligned(t: torch.Tensor) -> bool:
    size = t.element_size()
    return (
        t.stride(-1) == 1
        and (t.stride(-2) * size) % ALIGN_BYTES == 0
        and t.data_ptr() % ALIGN_BYTES == 0
        and all((s * size) % ALIGN_BYTES == 0 for s in t.stride()[:-2])
    )


def pad_rows(a: torch.Tensor, rows: int = ROW_TILE) -> torch.Tensor:
    """[..., M, K] -> [..., tiles, rows, K], the last tile zero-padded, every row aligned.

    Always a fresh buffer whose rows are `ALIGN_BYTES`-aligned (its row stride K rounded
    up): every tile has the same layout whatever the caller's strides were."""
    m, k = a.shape[-2], a.shape[-1]
    tiles = -(-m // rows)
    per_row = max(1, ALIGN_BYTES // a.element_size())
    width = -(-k // per_row) * per_row
    padded = a.new_zeros(*a.shape[:-2], tiles * rows, width)
    padded[..., :m, :k] = a
    return padded.view(*a.shape[:-2], tiles, rows, width)[..., :k]


def aligned_rows(a: torch.Tensor) -> torch.Tensor:
    """`a` itself if its rows are `ALIGN_BYTES`-aligned, else an aligned copy."""
    return a if _aligned(a) else pad_rows(a, a.shape[-2]).squeeze(-3)
