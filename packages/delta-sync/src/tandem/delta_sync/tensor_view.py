"""The interface the codec reads and patches a tensor through, wherever the tensor lives.

Implemented by `tensors.HostTensor` (host memory: numpy arrays and CPU torch tensors) and
`gpu.CudaTensor` (CUDA tensors, diffed and patched on the device); `tensors.view_of`
wraps a caller's array or tensor in the right one.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class TensorView(Protocol):
    """What the encoder and the patcher need from one tensor, wherever it lives."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    numel: int
    itemsize: int

    def read(self, start: int, stop: int) -> np.ndarray:
        """Host bit patterns of elements [start, stop) (a view when already on the host)."""
        ...

    def changed(self, base: TensorView, start: int, stop: int) -> np.ndarray:
        """Positions (relative to start, int64, ascending) where self differs from base."""
        ...

    def gather(self, start: int, idx: np.ndarray) -> np.ndarray:
        """Host bit patterns at positions start + idx."""
        ...

    def write(self, start: int, values: np.ndarray) -> None: ...

    def scatter(self, start: int, idx: np.ndarray, values: np.ndarray) -> None: ...

    def add_at(self, start: int, idx: np.ndarray, diff: np.ndarray) -> None:
        """Bit patterns at start + idx += diff, modulo 2^bits (idx unique, ascending)."""
        ...

    def xor_at(self, start: int, values: np.ndarray) -> None: ...

    def snapshot(self) -> TensorView:
        """An independent copy on the same device (the publisher's base for the next step)."""
        ...
