"""Single-threaded workers for the CPU tile products: who computes a tile, never how.

Every tile product must run on a thread whose OpenMP and BLAS thread count is 1 (a BLAS
given two threads may split the reduced dimension between them). `run_parallel` hands
whole jobs to `tile_threads()` such threads: the caller, its own counts set to 1
meanwhile, and a pool of workers started once per thread count.

`stock_ops_on_one_thread` keeps torch's own OpenMP team out of a forward pass: after each
of its parallel regions that team spins on the cores for a while, the cores the workers
need next.
"""

from __future__ import annotations

import ctypes
import queue
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch

T = TypeVar("T")


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

    def set(self, count: int) -> int:
        """Set this thread's counts; returns MKL's count before (0: the process-wide one)."""
        assert self.omp is not None
        self.omp.omp_set_num_threads(count)
        return self.mkl(count) if self.mkl is not None else 0

    @contextmanager
    def one(self) -> Iterator[None]:
        assert self.omp is not None
        before = self.omp.omp_get_max_threads()
        mkl_before = self.set(1)
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
            with _alone(caller):
                while not pending.empty():
                    take()
        for _ in jobs:
            done.acquire()
        if errors:
            raise errors[0]


_pools: dict[int, _Workers] = {}
_pools_lock = threading.Lock()
_caller = _ThreadLocalCount()
_scope = threading.local()  # .threads: the count `stock_ops_on_one_thread` keeps for tiles


def set_own_thread_count(count: int) -> None:
    """Set the calling thread's own OpenMP and MKL thread counts (what `torch.get_num_threads`
    and the tile products then use on it) and nothing else: unlike `torch.set_num_threads`,
    threads started later keep the process's count. Without a loadable OpenMP runtime, falls
    back to `torch.set_num_threads`."""
    if count < 1:
        raise ValueError(f"set_own_thread_count: count must be >= 1, got {count}")
    if not _caller.available:
        torch.set_num_threads(count)
        return
    torch.get_num_threads()  # torch's per-thread setup first: it would undo the count below
    _caller.set(count)


def tile_threads() -> int:
    """Threads the tile products share: torch's count for this thread, or the count it had
    when `stock_ops_on_one_thread` was entered."""
    return getattr(_scope, "threads", 0) or torch.get_num_threads()


@contextmanager
def stock_ops_on_one_thread() -> Iterator[None]:
    """While active, torch's own ops on this thread run single-threaded, and the tile
    products still share `torch.get_num_threads()` threads through `run_parallel`.

    Why: after each parallel region of a stock op, torch's OpenMP threads keep spinning for
    a while (libgomp's default), on the cores the tile workers need next. With 2 threads,
    batched decode's expert products then ran no faster than with one. A forward pass made
    of tile products and small element-wise ops loses little by running the latter on one
    thread, and those ops then run the same code whatever the thread count. Nests; no
    effect with one thread or without a loadable OpenMP runtime."""
    threads = tile_threads()
    if threads == 1 or not _caller.available or getattr(_scope, "threads", 0):
        yield
        return
    _workers(threads - 1)  # started outside: starting sets torch's process-wide count
    _scope.threads = threads
    try:
        with _caller.one():
            yield
    finally:
        _scope.threads = 0


@contextmanager
def _alone(caller: _ThreadLocalCount) -> Iterator[None]:
    """The calling thread computes whole jobs, single-threaded: torch's ops and any product
    a job runs (`tile_threads()` is 1 meanwhile), as on a worker."""
    before = getattr(_scope, "threads", 0)
    _scope.threads = 1
    try:
        with caller.one():
            yield
    finally:
        _scope.threads = before


def _workers(n: int) -> _Workers:
    with _pools_lock:
        if n not in _pools:
            _pools[n] = _Workers(n)
        return _pools[n]


SHARED_WORK = 4_000_000
"""Multiply-adds below which the caller computes every tile itself (it only moves who
computes them). The workers are Python threads: each tile product is a torch call that
gives up the GIL and takes it back, so with two threads a second core saves little on a
decode step's products (at most ~35M multiply-adds in `benchmarks/determinism.py`): with 2
threads, batched decode ran 2.07-2.24x stock torch whether products were shared from 4M or
kept on the caller below 64M, the training step 1.46-1.73x (run-to-run noise either way)."""


def run_parallel(jobs: list[Callable[[], None]], work: int) -> None:
    """Run independent jobs (`work` multiply-adds in all), each wholly on one single-threaded
    thread: the caller (its own OpenMP/MKL count set to 1 meanwhile) and
    `tile_threads() - 1` workers.

    With one thread the caller is single-threaded already and runs them in turn."""
    threads = tile_threads()
    if threads == 1:  # also inside a worker or a job: jobs never nest across threads
        for job in jobs:
            job()
        return
    if _caller.available:
        if len(jobs) == 1 or work < SHARED_WORK:
            with _alone(_caller):
                for job in jobs:
                    job()
            return
        _workers(threads - 1).run(jobs, _caller)
        return
    _workers(threads).run(jobs, None)


def run_parts(parts: list[Callable[[], T]]) -> list[T]:
    """Results of independent parts of one computation (attention of a few sequences each),
    each part run whole by one thread, single-threaded: the caller and the workers as in
    `run_parallel`. For work whose every step is cheap on its own (many small products and
    the element-wise ops between them), where sharing each step between threads would not
    pay. The caller's autograd and inference modes hold in the workers too."""
    results: list[T | None] = [None] * len(parts)
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def job(i: int) -> Callable[[], None]:
        def run() -> None:
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                results[i] = parts[i]()

        return run

    run_parallel([job(i) for i in range(len(parts))], SHARED_WORK)
    return results  # type: ignore[return-value]
