"""CUDA arrays that are not torch tensors: cupy arrays and any array speaking DLPack.

A JAX array, a cupy array, a numba device array or anything else with ``__dlpack__`` and
``__dlpack_device__`` that lives on a CUDA device is read through ``cupy.from_dlpack``
(zero-copy) and diffed and patched on its device by `cupy_array.CupyArray`, with no torch
installed. Torch CUDA tensors keep their own path (`gpu.CudaTensor`): they never reach here.

cupy is the optional ``gpu`` extra and is imported only when such an array is handed over;
without it the caller gets a one-line error naming the tensor and the extra to install.
"""

from __future__ import annotations

from typing import Any

from tandem.delta_sync.errors import DeltaSyncError

# DLPack's DLDeviceType codes of memory a CUDA kernel can address in place.
KDL_CUDA, KDL_CUDA_MANAGED = 2, 13
CUDA_DEVICE_TYPES = (KDL_CUDA, KDL_CUDA_MANAGED)


def dlpack_device(x: Any) -> tuple[int, int] | None:
    """``(device type, device id)`` of a DLPack producer; None for anything else."""
    if not hasattr(x, "__dlpack__"):
        return None
    device = getattr(x, "__dlpack_device__", None)
    if device is None:
        return None
    kind, index = device()
    return int(kind), int(index)


def is_cuda_array(x: Any) -> bool:
    """Whether ``x`` is a DLPack array in CUDA memory (and not a torch tensor)."""
    if type(x).__module__.split(".", 1)[0] == "torch":
        return False
    device = dlpack_device(x)
    return device is not None and device[0] in CUDA_DEVICE_TYPES


def import_cupy(name: str, x: Any) -> Any:
    """The cupy module, or a one-line error saying which tensor needed it and how to get it."""
    try:
        import cupy
    except ImportError:
        kind, index = dlpack_device(x) or (KDL_CUDA, 0)
        raise DeltaSyncError(
            f"tensor {name!r} is a {type(x).__name__} on CUDA device {index} (DLPack device "
            f"type {kind}); delta-sync diffs such arrays on the device with cupy, which is not "
            "installed: pip install 'tandem-delta-sync[gpu]' (or pass a torch tensor)"
        ) from None
    return cupy


def device_view(name: str, x: Any, *, writable: bool, cupy: Any = None) -> Any:
    """A `CupyArray` over a CUDA DLPack array, sharing its memory; None if ``x`` is not one.

    ``writable`` views are patched in place, so they must be cupy arrays: other producers
    (JAX arrays are immutable) are read, never written through a DLPack alias.
    ``cupy``: the module to use (the installed cupy when None).
    """
    if not is_cuda_array(x):
        return None
    from tandem.delta_sync.cupy_array import CupyArray

    xp = cupy if cupy is not None else import_cupy(name, x)
    if isinstance(x, xp.ndarray):
        arr = x
    elif writable:
        raise DeltaSyncError(
            f"tensor {name!r} is a {type(x).__name__}: delta-sync patches CUDA arrays in "
            "place only as cupy arrays or torch tensors; pass cupy.from_dlpack(x) and keep "
            "that array (its memory is x's)"
        )
    else:
        try:
            arr = xp.from_dlpack(x)
        except (TypeError, ValueError, NotImplementedError, BufferError) as e:
            raise DeltaSyncError(
                f"tensor {name!r}: cupy {getattr(xp, '__version__', '?')} cannot read this "
                f"{type(x).__name__} through DLPack ({e}); cupy >= 14 with ml_dtypes reads "
                "bfloat16, or pass a torch tensor"
            ) from None
    return CupyArray.wrap(name, arr, xp, writable=writable)
