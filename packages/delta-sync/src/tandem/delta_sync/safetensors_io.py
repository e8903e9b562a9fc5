"""Read and write safetensors files with numpy (no torch, no safetensors package needed).

    save_safetensors("model.safetensors", state, metadata={"step": "7"})
    tensors, metadata = load_safetensors("model.safetensors")

Layout: u64 little-endian header length, a JSON header {name: {dtype, shape,
data_offsets}, "__metadata__": {str: str}}, then the raw little-endian tensor bytes.
Reading checks the header against the file before any tensor is read: every tensor's
offsets lie inside the data, its length matches its dtype and shape, and no two tensors
overlap; a violation is one `DeltaSyncError` naming the file and the tensor.
"""

from __future__ import annotations

import itertools
import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from tandem.delta_sync.dtypes import (
    NUMPY_DTYPES,
    dtype_name_of_numpy,
    numpy_dtype,
    torch_int_view,
)
from tandem.delta_sync.errors import DeltaSyncError
from tandem.delta_sync.tensors import check_torch_tensor, is_torch_tensor

_TO_ST = {
    "bfloat16": "BF16",
    "float16": "F16",
    "float32": "F32",
    "float64": "F64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "int8": "I8",
    "uint8": "U8",
    "int16": "I16",
    "int32": "I32",
    "int64": "I64",
    "bool": "BOOL",
}
_FROM_ST = {v: k for k, v in _TO_ST.items()}
_NAMED = {"C64": "complex64", "U16": "uint16", "U32": "uint32", "U64": "uint64"}
MAX_HEADER = 100 << 20  # the reference implementation's limit


def _bad(path: Path, what: str) -> DeltaSyncError:
    return DeltaSyncError(f"{path}: {what}")


def _read_header(path: Path, size: int) -> tuple[int, dict[str, Any]]:
    if size < 8:
        raise _bad(path, f"too short to be a safetensors file ({size} bytes)")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > MAX_HEADER or 8 + n > size:
            raise _bad(
                path,
                f"the header says it is {n:,} bytes but the file has {size:,}: truncated, "
                "or not a safetensors file",
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise _bad(path, f"unreadable safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise _bad(path, "the safetensors header is not a JSON object")
    return n, header


def _entry(
    path: Path, name: str, meta: Any, data_bytes: int
) -> tuple[np.dtype, list[int], int, int]:
    """(dtype, shape, begin, end) of one tensor, checked against the data section's size."""
    if not isinstance(meta, dict) or not {"dtype", "shape", "data_offsets"} <= set(meta):
        raise _bad(path, f"tensor {name!r}: header entry lacks dtype, shape or data_offsets")
    st = meta["dtype"]
    if st not in _FROM_ST:
        known = f" ({_NAMED[st]})" if st in _NAMED else ""
        raise _bad(
            path,
            f"tensor {name!r}: unsupported dtype {st}{known} (delta-sync diffs "
            f"{', '.join(NUMPY_DTYPES)}); cast it before saving, or leave it out",
        )
    shape, offsets = meta["shape"], meta["data_offsets"]
    if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
        raise _bad(path, f"tensor {name!r}: bad shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise _bad(path, f"tensor {name!r}: bad data_offsets {offsets!r}")
    dtype = numpy_dtype(_FROM_ST[st])
    begin, end = offsets
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if end - begin != expected:
        raise _bad(
            path,
            f"tensor {name!r}: data_offsets span {end - begin:,} bytes but {st}{shape} takes "
            f"{expected:,}",
        )
    if end > data_bytes:
        raise _bad(
            path,
            f"tensor {name!r} ends at byte {end:,} of the data but the file holds only "
            f"{data_bytes:,}: the file is truncated",
        )
    return dtype, shape, begin, end


def _metadata(path: Path, header: dict[str, Any]) -> dict[str, str]:
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise _bad(path, "__metadata__ must map strings to strings")
    return dict(meta)


def load_safetensors(
    path: str | os.PathLike[str], *, as_torch: bool = False, mmap_mode: str | None = None
) -> tuple[dict[str, Any], dict[str, str]]:
    """(tensors, metadata) of a safetensors file: numpy arrays (bf16/fp8 through ml_dtypes)
    or, with `as_torch`, torch tensors bit for bit; metadata is the `__metadata__` strings.

    `mmap_mode` ("r" read-only, "r+" patched in place, as in `numpy.load`) returns views of
    the memory-mapped file instead of copies, so a state larger than memory can be
    published or pulled: the file must not change underneath while they are in use.

    Offsets are checked first: a truncated file, a tensor whose bytes lie outside the data
    or overlap another's, or an unsupported dtype raises DeltaSyncError naming the tensor.
    """
    path = Path(path)
    if mmap_mode not in (None, "r", "r+"):
        raise DeltaSyncError(f"mmap_mode must be None, 'r' or 'r+', got {mmap_mode!r}")
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise _bad(path, "no such file") from None
    except OSError as e:
        raise _bad(path, f"cannot read it ({e.strerror})") from None
    if path.is_dir():
        raise _bad(path, "is a directory, not a safetensors file")
    n, header = _read_header(path, size)
    data_bytes = size - 8 - n
    entries = {
        name: _entry(path, name, meta, data_bytes)
        for name, meta in header.items()
        if name != "__metadata__"
    }
    spans = sorted((b, e, name) for name, (_, _, b, e) in entries.items() if e > b)
    for (_, end, first), (begin, _, second) in itertools.pairwise(spans):
        if begin < end:
            raise _bad(path, f"tensors {first!r} and {second!r} overlap in the data section")
    metadata = _metadata(path, header)
    out: dict[str, Any] = {}
    data = np.memmap(path, np.uint8, mode=mmap_mode or "r") if size else np.empty(0, np.uint8)
    for name, (dtype, shape, begin, end) in entries.items():
        raw = data[8 + n + begin : 8 + n + end]
        if mmap_mode is None:
            raw = np.array(raw)  # a copy: the file may change
        out[name] = raw.view(dtype).reshape(shape)
    del data
    if as_torch:
        from tandem.delta_sync.torch_interop import to_torch

        out = to_torch(out)
    return out, metadata


def _host_array(name: str, x: Any) -> tuple[str, np.ndarray]:
    """(dtype name, little-endian C-contiguous host array) of a numpy array or torch tensor
    (copied to the host); unsupported dtypes and devices are refused naming the tensor."""
    if isinstance(x, np.ndarray):
        dtype = dtype_name_of_numpy(x.dtype, name)
        return dtype, np.ascontiguousarray(x, dtype=x.dtype.newbyteorder("<"))
    if not is_torch_tensor(x):
        raise DeltaSyncError(
            f"tensor {name!r} is a {type(x).__name__}; expected a numpy array or a torch tensor"
        )
    dtype = check_torch_tensor(name, x)
    t = x.detach().to("cpu").contiguous()
    return dtype, torch_int_view(t).numpy().view(numpy_dtype(dtype))


def save_safetensors(
    path: str | os.PathLike[str],
    tensors: Mapping[str, Any],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write `tensors` (numpy arrays or torch tensors) and string `metadata` as safetensors.

    Names are written in sorted order; a tensor under two names (tied) is written under
    each, as safetensors has no aliases. The file is written to a temporary name and then
    renamed, so a reader never sees half a file.
    """
    path = Path(path)
    if metadata is not None and not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise _bad(path, "metadata must map strings to strings")
    if not isinstance(tensors, Mapping):
        raise DeltaSyncError(f"tensors must be a mapping of name -> tensor, got {type(tensors)}")
    arrays = {name: _host_array(name, tensors[name]) for name in sorted(tensors)}
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, (dtype, a) in arrays.items():
        end = offset + a.nbytes
        header[name] = {
            "dtype": _TO_ST[dtype],
            "shape": list(a.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * ((-len(blob)) % 8)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for _, a in arrays.values():
                f.write(a.reshape(-1).view(np.uint8).data)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise _bad(path, f"cannot write it ({e.strerror or e})") from None


def load(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file (see load_safetensors)."""
    return load_safetensors(path)[0]


def save(path: str | os.PathLike[str], state: Mapping[str, Any]) -> None:
    """Write a safetensors file without metadata (see save_safetensors)."""
    save_safetensors(path, state)
