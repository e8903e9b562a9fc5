"""How many threads torch's CPU kernels use while a stage runs in this process."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run the block with ``count`` intra-op threads (0: leave torch's setting), then restore.

    The local RL backend runs the engine and the trainer as two threads of one process. Each
    op of either spreads over every core by default, so on a small machine they take cores
    from each other (and spin waiting for them); one thread each lets them run side by side.
    """
    if count < 0:
        raise ValueError(f"torch_threads: count must be >= 0, got {count}")
    before = torch.get_num_threads()
    if count:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
