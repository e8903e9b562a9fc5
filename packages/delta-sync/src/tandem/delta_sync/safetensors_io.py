"""Read and write the safetensors file layout with numpy (for the CLI; no torch needed).

Layout: u64 little-endian header length, a JSON header {name: {dtype, shape,
data_offsets}}, then the raw little-endian tensor bytes.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from tandem.delta_sync.dtypes import dtype_name_of_numpy, numpy_dtype
from tandem.delta_sync.errors import DeltaSyncError

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


def load(path: str | Path) -> dict[str, np.ndarray]:
    path = Path(path)
    data = np.memmap(path, np.uint8, mode="r")
    if data.size < 8:
        raise DeltaSyncError(f"{path}: too short to be a safetensors file")
    (n,) = struct.unpack("<Q", data[:8].tobytes())
    try:
        header = json.loads(data[8 : 8 + n].tobytes())
    except ValueError as e:
        raise DeltaSyncError(f"{path}: unreadable safetensors header ({e})") from None
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in _FROM_ST:
            raise DeltaSyncError(f"{path}: tensor {name!r} has unsupported dtype {meta['dtype']}")
        begin, end = meta["data_offsets"]
        dt = numpy_dtype(_FROM_ST[meta["dtype"]])
        raw = np.array(data[8 + n + begin : 8 + n + end])
        out[name] = raw.view(dt).reshape(meta["shape"])
    return out


def save(path: str | Path, state: dict[str, np.ndarray]) -> None:
    header, offset = {}, 0
    for name in sorted(state):
        a = state[name]
        header[name] = {
            "dtype": _TO_ST[dtype_name_of_numpy(a.dtype)],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * ((-len(blob)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name in sorted(state):
            f.write(np.ascontiguousarray(state[name]).reshape(-1).view(np.uint8).data)
