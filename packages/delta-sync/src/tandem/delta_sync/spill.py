"""Staged arrays moved to an unlinked file and memory-mapped back: a prepared version costs
page cache (reclaimable, written back to disk under pressure), not the process's memory.

A delta pull stages about 1.3 bytes per changed weight of decoded streams; at 1 TB and 2%
changed that is tens of GB, which must not have to fit in an engine's memory next to the
model. Arrays are written one batch (a shard's worth) at a time, each batch one mapping,
so the number of mappings grows with shards, not chunks.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import threading
from pathlib import Path

import numpy as np

from tandem.delta_sync.errors import DeltaSyncError

_ALIGN = 64


class Spill:
    """An append-only unlinked file in `directory`; `keep` moves arrays into it."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            # closed by `close`; the mappings made from it outlive it
            self._file = tempfile.TemporaryFile(dir=directory, prefix="staged-")  # noqa: SIM115
        except OSError as e:
            raise DeltaSyncError(f"cannot stage the prepared version in {directory}: {e}") from e
        self._end = 0
        self._lock = threading.Lock()
        self.nbytes = 0

    def keep(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """The same arrays (values, dtypes, shapes, writeable flags), now views of the file."""
        offsets, size = [], 0
        for a in arrays:
            offsets.append(size)
            size += -(-a.nbytes // _ALIGN) * _ALIGN
        if size == 0:
            return arrays
        try:
            with self._lock:  # one batch at a time: the file only grows
                start = self._end
                self._end += -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
                fd = self._file.fileno()
                for a, off in zip(arrays, offsets, strict=True):
                    data = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
                    if a.nbytes and os.pwrite(fd, data, start + off) != a.nbytes:
                        raise OSError("short write (is the disk full?)")
                os.ftruncate(fd, start + size)
            # copy-on-write: arrays may be writable (as the originals were), never written back
            m = mmap.mmap(fd, size, access=mmap.ACCESS_COPY, offset=start)
        except OSError as e:
            raise DeltaSyncError(
                f"cannot stage the prepared version in {self.directory}: {e}"
            ) from e
        out = []
        for a, off in zip(arrays, offsets, strict=True):
            v = np.frombuffer(m, a.dtype, a.size, off).reshape(a.shape)
            v.flags.writeable = a.flags.writeable
            out.append(v)
        self.nbytes += size
        return out

    def close(self) -> None:
        """Close the file (mapped views stay valid until they are dropped)."""
        self._file.close()
