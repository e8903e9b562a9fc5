"""numpy arrays as torch tensors, bit for bit, for the dtypes `torch.from_numpy` refuses.

`materialize`, `decode_full` and `load_safetensors` give numpy arrays; bf16 and fp8 ones
have ml_dtypes element types, which `torch.from_numpy` rejects. `to_torch` hands torch the
raw bits as an integer tensor of the same width and reinterprets them in the torch dtype
of the same name, so every pattern (NaN payloads, -0.0, subnormals) survives, and the
tensor shares the array's memory (no copy for C-contiguous arrays). torch is imported
only when this is called.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from tandem.delta_sync.dtypes import INT_BY_WIDTH, dtype_name_of_numpy
from tandem.delta_sync.errors import DeltaSyncError


def _array_to_torch(name: str | None, arr: np.ndarray) -> Any:
    try:
        import torch
    except ImportError:
        raise DeltaSyncError(
            "to_torch (as_torch=True) needs torch, which is not installed: pip install torch"
        ) from None

    dtype = dtype_name_of_numpy(arr.dtype, name)
    arr = np.ascontiguousarray(arr)
    if dtype in ("bool", "int8", "uint8"):
        return torch.from_numpy(arr)  # types torch.from_numpy takes as they are
    ints = np.dtype(np.uint8) if arr.itemsize == 1 else INT_BY_WIDTH[arr.itemsize]
    return torch.from_numpy(arr.view(ints)).view(getattr(torch, dtype))


def to_torch(x: np.ndarray | Mapping[str, np.ndarray]) -> Any:
    """A torch tensor for a numpy array (any dtype delta-sync handles), or a dict of them.

    Bit-exact and sharing memory with the arrays; names that are one array (tied tensors
    restored by `materialize`) stay one tensor.
    """
    if isinstance(x, np.ndarray):
        return _array_to_torch(None, x)
    done: dict[int, Any] = {}
    out = {}
    for name, arr in x.items():
        if id(arr) not in done:
            done[id(arr)] = _array_to_torch(name, arr)
        out[name] = done[id(arr)]
    return out
