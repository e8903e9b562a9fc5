"""What every chunk encoding is made of: the chunk modes, the record of an encoded chunk,
and its zstd frames (one per byte plane of an integer stream).

Each integer stream is split into byte planes (low byte first) and every plane is one zstd
frame: the planes have very different statistics, and zstd's literal coder builds one
Huffman table per block, so planes sharing a block would share a table. Compression and
decompression are one-shot calls, which release the GIL, so chunks encode in parallel.
Compression and decompression contexts are kept per thread.
"""

from __future__ import annotations

import threading

import msgspec
import numpy as np
import zstandard

from tandem.delta_sync.dtypes import UINT_BY_WIDTH
from tandem.delta_sync.errors import IntegrityError

UNCHANGED, SPARSE, XOR, RAW = 0, 1, 2, 3
MODE_NAMES = {UNCHANGED: "unchanged", SPARSE: "sparse", XOR: "xor", RAW: "raw"}


# Candidates worth trying, by changed fraction: below 20% changed neither XOR nor raw has
# come close to sparse on any state we measured, and above 50% sparse cannot win.
SPARSE_MAX_FRACTION = 0.5
XOR_MIN_FRACTION = 0.2

_local = threading.local()


class ChunkRecord(msgspec.Struct, array_like=True, frozen=True):
    """Where one encoded chunk sits in a shard and how to decode it."""

    tensor: int  # index into the shard's table of tensor names
    chunk: int
    mode: int
    count: int  # changed elements (sparse) or elements in the chunk (xor/raw)
    gap_width: int
    value_width: int
    frames: list[int]  # compressed length of each plane frame, in order

    @property
    def nbytes(self) -> int:
        return sum(self.frames)


class EncodedChunk(msgspec.Struct, frozen=True):
    chunk: int
    mode: int
    count: int
    gap_width: int
    value_width: int
    frames: list[bytes]

    @property
    def nbytes(self) -> int:
        return sum(len(f) for f in self.frames)


def _cctx(level: int) -> zstandard.ZstdCompressor:
    cache = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cache[level]


def _dctx() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstandard.ZstdDecompressor()
    return d


def _width_of(max_value: int) -> int:
    return max(1, (int(max_value).bit_length() + 7) // 8)


def _compress_planes(values: np.ndarray, width: int, level: int) -> list[bytes]:
    cctx = _cctx(level)
    if values.itemsize == 1:
        return [cctx.compress(np.ascontiguousarray(values).data)]
    b = values.view(np.uint8).reshape(-1, values.itemsize)
    return [cctx.compress(np.ascontiguousarray(b[:, i]).data) for i in range(width)]


def _decompress_planes(
    frames: list[memoryview], count: int, itemsize: int, where: str, pad: int = 0
) -> np.ndarray:
    """count values from their byte-plane frames (plus `pad` zeros after them)."""
    dctx = _dctx()
    out = np.zeros(count + pad, UINT_BY_WIDTH[itemsize])
    ob = out[:count].view(np.uint8).reshape(count, itemsize)
    for i, frame in enumerate(frames):
        try:
            plane = dctx.decompress(frame, max_output_size=count)
        except zstandard.ZstdError as e:
            raise IntegrityError(f"{where}: corrupt zstd frame ({e})") from None
        if len(plane) != count:
            raise IntegrityError(f"{where}: plane {i} has {len(plane)} bytes, expected {count}")
        ob[:, i] = np.frombuffer(plane, np.uint8)
    return out


def _gap_frames(gap_width: int) -> int:
    return 1 if gap_width == 1 else gap_width


def sparse_gap_frames(
    rec: ChunkRecord, frames: list[memoryview], n: int, itemsize: int, where: str
) -> int:
    """How many gap frames a sparse chunk has, once its record is checked against the chunk
    (``n`` elements of ``itemsize`` bytes) and its frame count: `IntegrityError` otherwise."""
    gw, ew, k = rec.gap_width, rec.value_width, rec.count
    if not 1 <= gw <= 6 or ew > itemsize or k > n:
        raise IntegrityError(f"{where}: malformed sparse chunk (widths {gw}/{ew}, {k} of {n})")
    ng = _gap_frames(gw)
    if len(frames) != ng + 1 + ew:
        raise IntegrityError(f"{where}: malformed sparse chunk ({len(frames)} frames)")
    return ng


def split_frames(rec: ChunkRecord, body: memoryview) -> list[memoryview]:
    out, pos = [], 0
    for n in rec.frames:
        out.append(body[pos : pos + n])
        pos += n
    return out


def _plane(frame: memoryview, size: int, where: str) -> np.ndarray:
    try:
        data = _dctx().decompress(frame, max_output_size=max(size, 1))
    except zstandard.ZstdError as e:
        raise IntegrityError(f"{where}: corrupt zstd frame ({e})") from None
    if len(data) != size:
        raise IntegrityError(f"{where}: plane has {len(data)} bytes, expected {size}")
    return np.frombuffer(data, np.uint8)
