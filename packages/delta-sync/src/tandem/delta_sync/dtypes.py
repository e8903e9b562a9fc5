"""Supported element types and the unsigned integer view each one is diffed in.

Every tensor is handled as the raw bit patterns of its elements (uint8/16/32/64), so the
delta is exact for -0.0, inf, NaN payloads and subnormals alike. Names and integer views
of torch tensors too, without importing torch unless it is handed a torch tensor.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from tandem.delta_sync.errors import DeltaSyncError

# name -> numpy dtype; names follow torch's spelling (without the "torch." prefix)
NUMPY_DTYPES: dict[str, np.dtype] = {
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "int8": np.dtype(np.int8),
    "uint8": np.dtype(np.uint8),
    "int16": np.dtype(np.int16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "bool": np.dtype(np.bool_),
}

UINT_BY_WIDTH: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.uint16),
    4: np.dtype(np.uint32),
    8: np.dtype(np.uint64),
}
INT_BY_WIDTH: dict[int, np.dtype] = {
    1: np.dtype(np.int8),
    2: np.dtype(np.int16),
    4: np.dtype(np.int32),
    8: np.dtype(np.int64),
}


def unsupported(tensor: str | None, dtype: object) -> DeltaSyncError:
    """The one-line refusal of a dtype delta-sync does not diff (naming the tensor)."""
    where = f"tensor {tensor!r}: " if tensor else ""
    return DeltaSyncError(
        f"{where}unsupported dtype {dtype} (delta-sync diffs {', '.join(NUMPY_DTYPES)}); "
        "cast it to one of those or leave it out of the state"
    )


def dtype_name_of_numpy(dtype: np.dtype, tensor: str | None = None) -> str:
    for name, dt in NUMPY_DTYPES.items():
        if dt == dtype:
            return name
    raise unsupported(tensor, dtype)


def supported_torch_dtype(t: Any, tensor: str) -> str:
    """The delta-sync name of a torch tensor's dtype; a one-line error naming it if none."""
    name = torch_dtype_name(t)
    if name not in NUMPY_DTYPES:
        raise unsupported(tensor, f"torch.{name}")
    return name


def numpy_dtype(name: str) -> np.dtype:
    try:
        return NUMPY_DTYPES[name]
    except KeyError:
        raise DeltaSyncError(
            f"unknown dtype {name!r} in delta metadata; this build supports "
            f"{', '.join(NUMPY_DTYPES)} (upgrade tandem-delta-sync?)"
        ) from None


def itemsize(name: str) -> int:
    return numpy_dtype(name).itemsize


def torch_dtype_name(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


def torch_int_view(t: Any) -> Any:
    """The same storage seen as a signed integer tensor of the same width."""
    import torch

    width = t.element_size()
    int_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width]
    return t if t.dtype == int_dtype else t.view(int_dtype)
