"""cupy arrays (and DLPack CUDA arrays read through cupy), diffed and patched on the device.

The same `TensorView` as `gpu.CudaTensor`, with cupy kernels instead of torch ops, so a
process holding JAX or cupy arrays publishes and pulls deltas without torch. The bit
patterns are handled as unsigned integers on the device (cupy has uint16/32/64
arithmetic), so a patch's additions wrap modulo 2^bits exactly as on the host. Only the
changed positions and values cross to the host when encoding; only the staged patch
crosses back when applying. The kernels are compiled by cupy on first use and cached by it.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from tandem.delta_sync.dtypes import UINT_BY_WIDTH, dtype_name_of_numpy
from tandem.delta_sync.errors import DeltaSyncError
from tandem.delta_sync.tensor_view import TensorView


class DeviceKernels:
    """The four element-wise kernels a delta needs, built with ``xp.ElementwiseKernel``."""

    def __init__(self, xp: Any) -> None:
        ek = xp.ElementwiseKernel
        self.not_equal = ek("T a, T b", "bool d", "d = a != b", "tandem_delta_ne")
        self.scatter = ek("int64 pos, T v", "raw T seg", "seg[pos] = v", "tandem_delta_scatter")
        # unsigned T: the sum is truncated back to T, i.e. taken modulo 2^bits
        self.scatter_add = ek(
            "int64 pos, T d",
            "raw T seg",
            "seg[pos] = (T)(seg[pos] + d)",
            "tandem_delta_scatter_add",
        )
        self.xor = ek("T v", "T seg", "seg ^= v", "tandem_delta_xor")


@functools.cache
def device_kernels(xp: Any) -> DeviceKernels:
    """One set of kernel objects per array module, so cupy compiles each once per dtype."""
    return DeviceKernels(xp)


class CupyArray:
    """A flat unsigned-integer view of a CUDA array, sharing the caller's memory."""

    def __init__(self, name: str, dtype: str, shape: tuple[int, ...], ints: Any, xp: Any) -> None:
        self.name = name
        self.dtype = dtype
        self.shape = shape
        self.ints = ints
        self.xp = xp
        self.numel = int(ints.size)
        self.itemsize = int(ints.itemsize)
        self._uint = UINT_BY_WIDTH[self.itemsize]
        self._k = device_kernels(xp)

    @classmethod
    def wrap(cls, name: str, arr: Any, xp: Any, *, writable: bool) -> CupyArray:
        dtype = dtype_name_of_numpy(np.dtype(arr.dtype), name)
        if not arr.flags.c_contiguous:
            if writable:
                raise DeltaSyncError(
                    f"tensor {name!r} is not a C-contiguous array, so it cannot be patched in "
                    "place; pass cupy.ascontiguousarray(...) and keep that array"
                )
            arr = xp.ascontiguousarray(arr)
        ints = arr.reshape(-1).view(UINT_BY_WIDTH[np.dtype(arr.dtype).itemsize])
        return cls(name, dtype, tuple(int(s) for s in arr.shape), ints, xp)

    def _up(self, values: np.ndarray) -> Any:
        return self.xp.asarray(np.ascontiguousarray(values, dtype=self._uint))

    def _reach(self, stop: int) -> None:
        """Refuse a patch past the end: a raw kernel must never write out of bounds."""
        if stop > self.numel:
            raise DeltaSyncError(
                f"tensor {self.name!r}: patch reaches element {stop - 1} of {self.numel}"
            )

    def _idx(self, start: int, idx: np.ndarray, n: int) -> Any:
        """``idx`` (ascending, as the codec makes it) on the device, checked first."""
        if idx.size != n or int(idx[0]) < 0:
            raise DeltaSyncError(
                f"tensor {self.name!r}: a patch of {idx.size} positions and {n} values"
            )
        self._reach(start + int(idx[-1]) + 1)
        return self.xp.asarray(np.ascontiguousarray(idx, dtype=np.int64))

    def read(self, start: int, stop: int) -> np.ndarray:
        return np.asarray(self.xp.asnumpy(self.ints[start:stop])).view(self._uint)

    def _segment_of(self, base: TensorView, start: int, stop: int) -> Any:
        if isinstance(base, CupyArray):
            return base.ints[start:stop]
        return self._up(base.read(start, stop))

    def changed(self, base: TensorView, start: int, stop: int) -> np.ndarray:
        mask = self._k.not_equal(self.ints[start:stop], self._segment_of(base, start, stop))
        return np.asarray(self.xp.asnumpy(self.xp.flatnonzero(mask)), dtype=np.int64)

    def gather(self, start: int, idx: np.ndarray) -> np.ndarray:
        if not idx.size:
            return np.empty(0, self._uint)
        dev = self._idx(start, idx, idx.size)
        return np.asarray(self.xp.asnumpy(self.ints[start:][dev])).view(self._uint)

    def write(self, start: int, values: np.ndarray) -> None:
        self._reach(start + values.size)
        self.ints[start : start + values.size] = self._up(values)

    def scatter(self, start: int, idx: np.ndarray, values: np.ndarray) -> None:
        if idx.size:
            self._k.scatter(self._idx(start, idx, values.size), self._up(values), self.ints[start:])

    def add_at(self, start: int, idx: np.ndarray, diff: np.ndarray) -> None:
        if idx.size:
            dev = self._idx(start, idx, diff.size)
            self._k.scatter_add(dev, self._up(diff), self.ints[start:])

    def xor_at(self, start: int, values: np.ndarray) -> None:
        if values.size:
            self._reach(start + values.size)
            self._k.xor(self._up(values), self.ints[start : start + values.size])

    def snapshot(self) -> CupyArray:
        return CupyArray(self.name, self.dtype, self.shape, self.ints.copy(), self.xp)
