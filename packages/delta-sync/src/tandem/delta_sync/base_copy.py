"""The publisher's copies of the last version (and anchor): in memory, or memory-mapped.

A publisher diffs every version against the one before, so it keeps a copy of it. For a
model larger than the host's spare memory, `base_dir` puts the copies of host tensors in
files there, memory-mapped: the kernel pages them in and out, so the publisher's own
memory stays at a few chunks per worker whatever the model size. Each file is unlinked
as soon as it is mapped, so nothing is left behind however the process ends; the disk
space is returned when the copy is dropped.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from tandem.delta_sync.errors import DeltaSyncError
from tandem.delta_sync.tensor_view import TensorView
from tandem.delta_sync.tensors import HostTensor

_COPY_STEP = 64 << 20  # bytes copied per slice: no second copy of a tensor in memory


def keep_copy(views: Mapping[str, TensorView], base_dir: Path | None) -> dict[str, TensorView]:
    """Independent copies of `views`: on their device, or (host tensors, with `base_dir`)
    in one memory-mapped file under `base_dir`."""
    host = {n: v for n, v in views.items() if isinstance(v, HostTensor)}
    total = sum(v.flat.nbytes for v in host.values())
    if base_dir is None or total == 0:
        return {n: v.snapshot() for n, v in views.items()}
    try:
        base_dir.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix="base-", suffix=".bin", dir=base_dir)
        try:
            os.ftruncate(fd, total)
            mapped = np.memmap(name, np.uint8, mode="r+", shape=(total,))
        finally:
            os.close(fd)
            os.unlink(name)  # the mapping keeps the data; no file outlives the process
    except OSError as e:
        raise DeltaSyncError(f"cannot keep the publisher's base copy in {base_dir}: {e}") from e
    out: dict[str, TensorView] = {}
    offset = 0
    for n, v in views.items():
        if not isinstance(v, HostTensor):
            out[n] = v.snapshot()
            continue
        nbytes = v.flat.nbytes
        flat = mapped[offset : offset + nbytes].view(v.flat.dtype)
        step = max(1, _COPY_STEP // v.itemsize)
        for s in range(0, v.numel, step):
            flat[s : s + step] = v.flat[s : s + step]
        out[n] = HostTensor(v.name, v.dtype, v.shape, flat)
        offset += nbytes
    return out
