"""Uniform access to numpy arrays and torch tensors as flat vectors of bit patterns.

`view_of` wraps each in a `TensorView`, the interface the codec reads and patches tensors
through: a `HostTensor` (here) for host memory, a `CudaTensor` (`tandem.delta_sync.gpu`,
diffed and patched on the device) for a CUDA tensor. The codec only ever sees unsigned
integer views (uint8/16/32/64). Torch is never imported here: a tensor is recognised by
the module its type comes from, and torch is only touched for objects that already are
torch tensors (so the caller has imported it). Also here: how a tensor is cut into chunks,
and the digests computed over them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import xxhash

from tandem.delta_sync.dtypes import (
    UINT_BY_WIDTH,
    dtype_name_of_numpy,
    numpy_dtype,
    supported_torch_dtype,
    torch_int_view,
)
from tandem.delta_sync.errors import DeltaSyncError
from tandem.delta_sync.gpu import CudaTensor
from tandem.delta_sync.tensor_view import TensorView


def is_torch_tensor(x: Any) -> bool:
    return type(x).__module__.split(".", 1)[0] == "torch" and hasattr(x, "dtype")


class HostTensor:
    """A C-contiguous host array (numpy, or a CPU torch tensor sharing its memory)."""

    def __init__(self, name: str, dtype: str, shape: tuple[int, ...], flat: np.ndarray) -> None:
        self.name = name
        self.dtype = dtype
        self.shape = shape
        self.flat = flat
        self.numel = int(flat.size)
        self.itemsize = int(flat.itemsize)

    def read(self, start: int, stop: int) -> np.ndarray:
        return self.flat[start:stop]

    def changed(self, base: TensorView, start: int, stop: int) -> np.ndarray:
        new = self.flat[start:stop]
        old = base.read(start, stop)
        mask = new != old
        if not mask.any():
            return np.empty(0, np.int64)
        return np.flatnonzero(mask)

    def gather(self, start: int, idx: np.ndarray) -> np.ndarray:
        return self.flat[start : start + (int(idx[-1]) + 1 if idx.size else 0)][idx]

    def write(self, start: int, values: np.ndarray) -> None:
        self.flat[start : start + values.size] = values

    def scatter(self, start: int, idx: np.ndarray, values: np.ndarray) -> None:
        if idx.size:
            self.flat[start : start + int(idx[-1]) + 1][idx] = values

    def add_at(self, start: int, idx: np.ndarray, diff: np.ndarray) -> None:
        from tandem.delta_sync.codec import kernels  # numba: imported on first use

        if idx.size:
            stop = start + int(idx[-1]) + 1  # idx ascending: its last is the largest
            if stop > self.numel or idx.size != diff.size:
                raise DeltaSyncError(
                    f"tensor {self.name!r}: patch reaches element {stop - 1} of {self.numel}"
                )
            kernels.scatter_add(self.flat[start:stop], idx, diff)

    def xor_at(self, start: int, values: np.ndarray) -> None:
        self.flat[start : start + values.size] ^= values

    def snapshot(self) -> HostTensor:
        return HostTensor(self.name, self.dtype, self.shape, self.flat.copy())

    def to_numpy(self) -> np.ndarray:
        """The array with its real dtype (bf16/fp8 through ml_dtypes)."""
        return self.flat.view(numpy_dtype(self.dtype)).reshape(self.shape)


def check_torch_tensor(name: str, t: Any) -> str:
    """The dtype name of a torch tensor delta-sync can read; one-line errors naming it if not."""
    device = t.device.type
    if device == "meta":
        raise DeltaSyncError(
            f"tensor {name!r} is on the meta device (a shape without data); load its weights "
            "first (e.g. module.to_empty(device='cpu'), then load_state_dict) or leave it out"
        )
    if device not in ("cpu", "cuda"):
        raise DeltaSyncError(
            f"tensor {name!r} is on device {t.device}; delta-sync reads CPU and CUDA tensors: "
            "move it with .cpu() first"
        )
    if getattr(t, "layout", None) is not None and str(t.layout) != "torch.strided":
        raise DeltaSyncError(
            f"tensor {name!r} has layout {t.layout}; delta-sync reads dense tensors: "
            "pass .to_dense() of it"
        )
    return supported_torch_dtype(t, name)


def view_of(name: str, x: Any, *, writable: bool = False) -> TensorView:
    """Wrap a numpy array or torch tensor; `writable` views must alias the caller's memory."""
    if is_torch_tensor(x):
        dtype = check_torch_tensor(name, x)
        if x.device.type == "cuda":
            return CudaTensor.wrap(name, x, writable=writable)
        return _torch_cpu_view(name, x, dtype, writable)
    if isinstance(x, np.ndarray):
        return _numpy_view(name, x, writable)
    from tandem.delta_sync.dlpack import device_view  # cupy, JAX and other DLPack CUDA arrays

    device = device_view(name, x, writable=writable)
    if device is not None:
        return device
    raise DeltaSyncError(
        f"tensor {name!r} is a {type(x).__name__}; expected a numpy array, a torch tensor "
        "or a CUDA array (cupy, DLPack)"
    )


def _numpy_view(name: str, arr: np.ndarray, writable: bool) -> HostTensor:
    dtype = dtype_name_of_numpy(arr.dtype, name)
    if not arr.flags.c_contiguous or not arr.dtype.isnative:
        if writable:
            raise DeltaSyncError(
                f"tensor {name!r} is not a C-contiguous native-endian array, so it cannot be "
                "patched in place; pass np.ascontiguousarray(...) and keep that array"
            )
        arr = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("="))
    if writable and not arr.flags.writeable:
        raise DeltaSyncError(f"tensor {name!r} is read-only; cannot apply a delta in place")
    flat = arr.reshape(-1).view(UINT_BY_WIDTH[arr.itemsize])
    return HostTensor(name, dtype, tuple(int(s) for s in arr.shape), flat)


def _torch_cpu_view(name: str, t: Any, dtype: str, writable: bool) -> HostTensor:
    t = t.detach()
    if not t.is_contiguous():
        if writable:
            raise DeltaSyncError(
                f"tensor {name!r} is not contiguous, so it cannot be patched in place; "
                "call .contiguous() on it and keep that tensor"
            )
        t = t.contiguous()
    flat = torch_int_view(t).reshape(-1).numpy().view(UINT_BY_WIDTH[t.element_size()])
    return HostTensor(name, dtype, tuple(int(s) for s in t.shape), flat)


def views_of(state: Mapping[str, Any], *, writable: bool = False) -> dict[str, TensorView]:
    if not isinstance(state, Mapping):
        raise DeltaSyncError(f"a state must be a mapping of name -> tensor, got {type(state)}")
    return {name: view_of(name, state[name], writable=writable) for name in sorted(state)}


def chunk_elems_for(itemsize: int, chunk_bytes: int) -> int:
    return max(1, chunk_bytes // itemsize)


def n_chunks(numel: int, chunk_elems: int) -> int:
    return max(1, -(-numel // chunk_elems))


def chunk_digest(values: np.ndarray) -> bytes:
    return xxhash.xxh3_128_digest(np.ascontiguousarray(values).data)


def combine_digest(dtype: str, shape: tuple[int, ...], chunk_digests: list[bytes]) -> str:
    """Tensor digest: xxh3-128 over dtype, shape and the xxh3-128 of each chunk, in order.

    Hashing chunk by chunk lets every worker hash its own chunk while it is hot in cache.
    """
    h = xxhash.xxh3_128()
    h.update(f"{dtype}{list(shape)}".encode())
    for d in chunk_digests:
        h.update(d)
    return h.hexdigest()


def tensor_digest(view: TensorView, chunk_elems: int) -> str:
    digests = [
        chunk_digest(view.read(s, min(s + chunk_elems, view.numel)))
        for s in range(0, max(view.numel, 1), chunk_elems)
    ]
    return combine_digest(view.dtype, view.shape, digests)


def state_digest(tensor_digests: Mapping[str, str]) -> str:
    """A version's digest: xxh3-128 over the sorted (name, tensor digest) pairs."""
    h = xxhash.xxh3_128()
    for name in sorted(tensor_digests):
        h.update(name.encode() + b"\0" + tensor_digests[name].encode() + b"\0")
    return h.hexdigest()
