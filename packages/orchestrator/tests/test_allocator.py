"""`reuse_freed_memory`: after it, a large block comes from the heap (not a fresh mmap), in
the main thread and in others, and freed memory is reused instead of being mapped again.
Checked in a child process (the setting is process-wide) through glibc's own accounting,
`mallinfo2`."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys

import pytest

from tandem.orchestrator.runtime.allocator import reuse_freed_memory

CHILD = """
import ctypes, json, sys, threading
import numpy as np
from tandem.orchestrator.runtime.allocator import reuse_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
applied = reuse_freed_memory() if sys.argv[1] == "tuned" else False
size = 64 << 20
mapped = libc.mallinfo2().hblkhd
a = np.ones(size, dtype=np.uint8)
mapped_for_block = libc.mallinfo2().hblkhd - mapped
del a
heap = libc.mallinfo2().arena
b = np.ones(size, dtype=np.uint8)  # the same size again, after the free
heap_growth = libc.mallinfo2().arena - heap
box = {}
def in_thread():  # the local trainer and engine run in worker threads
    before = libc.mallinfo2().hblkhd
    c = np.ones(size, dtype=np.uint8)
    box["mapped"] = libc.mallinfo2().hblkhd - before
    box["sum"] = int(c.sum())
t = threading.Thread(target=in_thread)
t.start()
t.join()
print(json.dumps({"applied": applied, "mapped": mapped_for_block, "heap_growth": heap_growth,
                  "size": size, "sum": int(b.sum()), "thread_mapped": box["mapped"],
                  "thread_sum": box["sum"]}))
"""


def _glibc_has_mallinfo2() -> bool:
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
    except OSError:
        return False


def _child(mode: str) -> dict[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not _glibc_has_mallinfo2(), reason="needs glibc >= 2.33 (mallinfo2)")
def test_large_blocks_come_from_the_heap_and_are_reused():
    default, tuned = _child("default"), _child("tuned")
    size = default["size"]
    for run in (default, tuned):  # the arrays were really written
        assert run["sum"] == run["thread_sum"] == size
    # glibc's defaults: a 64 MiB block is a fresh mapping of its own, in any thread
    assert default["mapped"] >= size
    assert default["thread_mapped"] >= size
    # tuned: no mapping for the block, and its freed memory serves the next one of its size
    assert tuned["applied"] is True
    assert tuned["mapped"] == 0
    assert tuned["heap_growth"] < size // 16
    assert tuned["thread_mapped"] == 0


def test_keep_bytes_must_be_positive():
    with pytest.raises(ValueError, match="keep_bytes must be > 0"):
        reuse_freed_memory(0)
