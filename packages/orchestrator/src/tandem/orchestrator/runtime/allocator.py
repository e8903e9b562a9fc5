"""Let the C heap keep freed memory for reuse (glibc), instead of unmapping it at every free.

A trainer step allocates and frees hundreds of MB per micro-batch (attention blocks gathered
for the backward pass, their gradients). Under glibc's defaults each block that large is a
fresh ``mmap`` that is unmapped when freed, so every step the kernel maps and zeroes the same
memory again. On a 2-core CPU, a step on 4 groups x 8 sequences of 650-1300 tokens (one torch
thread, the trainer in a worker thread as in ``RLRun``) took 13.9 s, 40% of its CPU time in
the kernel; with the heap keeping its memory it took 8.3 s. Raising glibc's mmap and trim
thresholds (and using one arena, see `reuse_freed_memory`) makes such blocks come from the
heap and stay there for the next micro-batch.

This sets process-wide state, so only process entry points call it: the ``tandem`` command
and the Ray actors it starts, next to where they set torch's thread count.
"""

from __future__ import annotations

import ctypes
import sys

import structlog

log = structlog.get_logger()

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
"""glibc ``mallopt`` parameters (malloc.h)."""

KEEP_BYTES = 1 << 30
"""Blocks up to this size come from the heap, and up to this much free memory at its top
stays mapped."""


def reuse_freed_memory(keep_bytes: int = KEEP_BYTES) -> bool:
    """Raise glibc's mmap and trim thresholds to ``keep_bytes`` and let every thread share
    one arena; True when glibc took all three settings, False where the C library is not
    glibc (nothing changes there)."""
    if keep_bytes <= 0:
        raise ValueError(f"reuse_freed_memory: keep_bytes must be > 0, got {keep_bytes}")
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl or another C library: keep its defaults
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    value = min(keep_bytes, 2**31 - 1)
    # One arena for every thread: a thread's own arena grows in heaps of at most 64 MiB and
    # maps any larger block by itself whatever the threshold (the local trainer and engine
    # run in worker threads).
    done = all(
        mallopt(param, v) == 1
        for param, v in ((M_ARENA_MAX, 1), (M_MMAP_THRESHOLD, value), (M_TRIM_THRESHOLD, value))
    )
    log.debug("allocator.reuse_freed_memory", keep_bytes=value, applied=done)
    return done
