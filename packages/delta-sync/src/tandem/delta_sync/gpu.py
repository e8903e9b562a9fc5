"""CUDA tensors, diffed and patched on the device with torch.

The publisher compares the new and base bit patterns on the GPU and copies only the
positions and values of changed elements to the host (plus whole chunks for the rare dense
chunks); the subscriber uploads only the staged patch and applies it with an indexed add
on the GPU. Digests are xxh3 on the host, so verification streams each chunk to the host.

torch is imported only when a CUDA tensor is handled (the caller has then imported it).
CUDA arrays that are not torch tensors (cupy, JAX and other DLPack producers) take the cupy
path instead (`dlpack.device_view`, `cupy_array.CupyArray`), which needs no torch; where
both could serve an array, `benchmarks/delta_sync.py --gpu` measures which is faster.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tandem.delta_sync.dtypes import UINT_BY_WIDTH, numpy_dtype, torch_dtype_name, torch_int_view
from tandem.delta_sync.errors import DeltaSyncError
from tandem.delta_sync.tensor_view import TensorView


def _host_int(values: np.ndarray) -> np.ndarray:
    """numpy bit patterns in the dtype torch_int_view uses (uint8 or signed)."""
    return values if values.itemsize == 1 else values.view(f"i{values.itemsize}")


class CudaTensor:
    def __init__(self, name: str, dtype: str, shape: tuple[int, ...], ints: Any) -> None:
        self.name = name
        self.dtype = dtype
        self.shape = shape
        self.ints = ints  # flat integer view on the device, sharing the caller's storage
        self.numel = int(ints.numel())
        self.itemsize = int(ints.element_size())
        self._uint = UINT_BY_WIDTH[self.itemsize]

    @classmethod
    def wrap(cls, name: str, t: Any, *, writable: bool) -> CudaTensor:
        dtype = torch_dtype_name(t)
        numpy_dtype(dtype)
        t = t.detach()
        if not t.is_contiguous():
            if writable:
                raise DeltaSyncError(
                    f"tensor {name!r} is not contiguous, so it cannot be patched in place; "
                    "call .contiguous() on it and keep that tensor"
                )
            t = t.contiguous()
        return cls(name, dtype, tuple(int(s) for s in t.shape), torch_int_view(t).reshape(-1))

    def _to_device(self, values: np.ndarray) -> Any:
        import torch

        return torch.from_numpy(np.ascontiguousarray(_host_int(values))).to(
            self.ints.device, non_blocking=False
        )

    def _idx(self, idx: np.ndarray) -> Any:
        import torch

        return torch.from_numpy(np.ascontiguousarray(idx, dtype=np.int64)).to(self.ints.device)

    def read(self, start: int, stop: int) -> np.ndarray:
        return self.ints[start:stop].cpu().numpy().view(self._uint)

    def _segment_of(self, base: TensorView, start: int, stop: int) -> Any:
        if isinstance(base, CudaTensor):
            return base.ints[start:stop]
        return self._to_device(base.read(start, stop))

    def changed(self, base: TensorView, start: int, stop: int) -> np.ndarray:
        import torch

        mask = self.ints[start:stop] != self._segment_of(base, start, stop)
        return torch.nonzero(mask).flatten().cpu().numpy()

    def gather(self, start: int, idx: np.ndarray) -> np.ndarray:
        if not idx.size:
            return np.empty(0, self._uint)
        return self.ints[start:][self._idx(idx)].cpu().numpy().view(self._uint)

    def write(self, start: int, values: np.ndarray) -> None:
        self.ints[start : start + values.size].copy_(self._to_device(values))

    def scatter(self, start: int, idx: np.ndarray, values: np.ndarray) -> None:
        if idx.size:
            self.ints[start:][self._idx(idx)] = self._to_device(values)

    def add_at(self, start: int, idx: np.ndarray, diff: np.ndarray) -> None:
        if idx.size:
            seg, i = self.ints[start:], self._idx(idx)
            seg[i] = seg[i] + self._to_device(diff)  # integer adds wrap modulo 2^bits

    def xor_at(self, start: int, values: np.ndarray) -> None:
        seg = self.ints[start : start + values.size]
        seg.bitwise_xor_(self._to_device(values))

    def snapshot(self) -> CudaTensor:
        return CudaTensor(self.name, self.dtype, self.shape, self.ints.clone())
