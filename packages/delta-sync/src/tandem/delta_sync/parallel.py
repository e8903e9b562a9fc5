"""Bounded, ordered fan-out over a thread pool, and pools kept across versions.

`Executor.map` submits every task at once, which would hold every encoded chunk of a model
in memory; here at most `window` tasks are in flight, so peak extra memory is a few chunks.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def default_workers() -> int:
    return max(1, min(32, os.cpu_count() or 1))


def ordered_map(
    pool: ThreadPoolExecutor, fn: Callable[[T], R], items: Iterable[T], window: int
) -> Iterator[R]:
    """Results of fn over items, in order, with at most `window` tasks outstanding.

    If a task fails (or the consumer stops early), tasks not yet started are cancelled and
    the ones already running are waited for, so no work is still running on return.
    """
    it = iter(items)
    pending: deque[Future[R]] = deque()
    try:
        for item in it:
            pending.append(pool.submit(fn, item))
            if len(pending) >= window:
                break
        while pending:
            result = pending.popleft().result()
            for item in it:
                pending.append(pool.submit(fn, item))
                break
            yield result
    finally:
        for fut in pending:
            fut.cancel()
        wait(pending)


class KeptPool:
    """A thread pool started on first use and kept until `close`, so that publishing or
    pulling a version does not pay for starting threads (a fixed cost per version that
    matters when deltas are small)."""

    def __init__(self, workers: int, name: str) -> None:
        self.workers = workers
        self.name = name
        self._pool: ThreadPoolExecutor | None = None

    def get(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix=self.name)
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
