"""Per-chunk encoding of one tensor's change: the smallest of unchanged/sparse/XOR/raw.

A chunk is a fixed run of elements of one tensor, handled as unsigned bit patterns.

* sparse: positions of the changed elements as gaps (zero-based distance to the previous
  change) and the zig-zag of (new - old) mod 2^bits. Adam at RL learning rates moves most
  changed bf16 weights by one ulp, so the differences are mostly 1 or 2 after zig-zag;
  they are stored as 2-bit codes packed four per byte plus an escape stream (pack_small).
* xor: new ^ old for every element (wins when most elements change a little).
* raw: the new bit patterns (anchors, or a chunk unrelated to its base).

Each integer stream is stored as zstd frames of its byte planes (see `frames`). This module
defines the encodings with whole-array numpy operations and picks a chunk's mode; the
compiled sparse path that publishing and pulling run is in `sparse`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tandem.delta_sync.codec.frames import (
    RAW,
    SPARSE,
    SPARSE_MAX_FRACTION,
    XOR,
    XOR_MIN_FRACTION,
    ChunkRecord,
    EncodedChunk,
    _cctx,
    _compress_planes,
    _decompress_planes,
    _width_of,
    sparse_gap_frames,
)
from tandem.delta_sync.codec.sparse import (
    apply_streams,
    decode_streams,
    decompress_sparse,
    encode_sparse_scan,
)
from tandem.delta_sync.dtypes import INT_BY_WIDTH, UINT_BY_WIDTH
from tandem.delta_sync.errors import IntegrityError
from tandem.delta_sync.tensor_view import TensorView
from tandem.delta_sync.tensors import HostTensor


def zigzag(diff: np.ndarray) -> np.ndarray:
    """Signed difference (held in its unsigned type, mod 2^bits) -> small unsigned codes."""
    bits = diff.itemsize * 8
    s = diff.view(INT_BY_WIDTH[diff.itemsize])
    return ((s << 1) ^ (s >> (bits - 1))).view(diff.dtype)


def unzigzag(z: np.ndarray) -> np.ndarray:
    one = z.dtype.type(1)
    return (z >> one) ^ (np.zeros_like(z) - (z & one))


def pack_small(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split codes v >= 0 into min(v, 3) packed four to a byte, and escapes v - 3 for v >= 3.

    zstd's Huffman coder spends at least one bit per byte, while a step's differences carry
    under two bits each (mostly +-1); packing four 2-bit codes per byte lets the coder see
    their joint distribution, which brings the values close to their entropy.
    """
    low = np.minimum(v, 3).astype(np.uint8)
    escapes = v[low == 3] - v.dtype.type(3)
    pad = (-low.size) % 4
    if pad:
        low = np.concatenate([low, np.zeros(pad, np.uint8)])
    q = low.reshape(-1, 4)
    packed = q[:, 0] | (q[:, 1] << 2) | (q[:, 2] << 4) | (q[:, 3] << 6)
    return packed, escapes


def unpack_small(packed: np.ndarray, count: int) -> np.ndarray:
    shifts = np.array([0, 2, 4, 6], np.uint8)
    return ((packed[:, None] >> shifts) & 3).reshape(-1)[:count]


def _encode_gaps(gaps: np.ndarray, level: int) -> tuple[int, list[bytes]]:
    """(gap_width code, frames): the low byte plane, then, when any gap exceeds 255, the
    high part (gap >> 8) as packed 2-bit codes plus escape planes.

    At low densities the high part is mostly 0 or 1; packing it keeps the position cost
    close to the entropy of the changed mask instead of paying Huffman's one bit per byte.
    gap_width is 1 without a high part, else 2 + the width of its escape planes.
    """
    cctx = _cctx(level)
    frames = [cctx.compress(np.ascontiguousarray(gaps.astype(np.uint8)).data)]
    if int(gaps.max(initial=0)) < 256:
        return 1, frames
    packed, escapes = pack_small(gaps >> np.uint32(8))
    hw = _width_of(escapes.max()) if escapes.size else 0
    frames.append(cctx.compress(packed.data))
    if hw:
        frames += _compress_planes(escapes, hw, level)
    return 2 + hw, frames


def _decode_gaps(gap_width: int, frames: list[memoryview], k: int, where: str) -> np.ndarray:
    gaps = _decompress_planes(frames[:1], k, 4, where)
    if gap_width >= 2:
        high = unpack_small(_decompress_planes(frames[1:2], (k + 3) // 4, 1, where), k)
        high = high.astype(np.uint32)
        if gap_width > 2:
            esc = high == 3
            high[esc] += _decompress_planes(frames[2:gap_width], int(esc.sum()), 4, where)
        gaps |= high << np.uint32(8)
    return gaps


def encode_sparse(
    chunk: int, idx: np.ndarray, old: np.ndarray, new: np.ndarray, level: int
) -> EncodedChunk:
    gaps = (np.diff(idx, prepend=-1) - 1).astype(np.uint32)
    v = zigzag(new - old) - new.dtype.type(1)  # changed elements have a nonzero difference
    packed, escapes = pack_small(v)
    gw, frames = _encode_gaps(gaps, level)
    ew = _width_of(escapes.max()) if escapes.size else 0
    frames.append(_cctx(level).compress(packed.data))
    if ew:
        frames += _compress_planes(escapes, ew, level)
    return EncodedChunk(chunk, SPARSE, int(idx.size), gw, ew, frames)


def encode_dense(chunk: int, values: np.ndarray, mode: int, level: int) -> EncodedChunk:
    return EncodedChunk(
        chunk,
        mode,
        int(values.size),
        0,
        values.itemsize,
        _compress_planes(values, values.itemsize, level),
    )


def encode_chunk(
    new: TensorView,
    base: TensorView | None,
    chunk: int,
    chunk_elems: int,
    level: int,
    *,
    advance_base: bool = False,
    hasher: Any = None,
    base_hasher: Any = None,
) -> tuple[EncodedChunk | None, int]:
    """(smallest encoding of chunk `chunk` of `new` against `base`, changed elements).

    The encoding is None for an unchanged chunk. Without a base (an anchor) the chunk is
    stored raw. With `advance_base`, the base chunk is then overwritten with the new bits
    (only the changed elements when they are few), so a publisher's copy of the previous
    version becomes the new one without copying the whole model every step. `hasher`, if
    given, is a fresh xxh3 state, fed exactly this chunk of `new` by the time this returns
    (during the scan when the sparse kernels run); `base_hasher` likewise with the chunk
    of `base` as it was (not with `advance_base`).
    """
    start = chunk * chunk_elems
    stop = min(start + chunk_elems, new.numel)
    if base is None:
        values = new.read(start, stop)
        if hasher is not None:
            hasher.update(np.ascontiguousarray(values))
        return encode_dense(chunk, values, RAW, level), stop - start
    if isinstance(new, HostTensor) and isinstance(base, HostTensor):
        enc, k = encode_sparse_scan(
            chunk,
            new.read(start, stop),
            base.read(start, stop),
            level,
            advance=advance_base,
            hasher=hasher,
            base_hasher=base_hasher,
        )
        if k >= 0:
            return enc, k
        for h in (hasher, base_hasher):
            if h is not None:
                h.reset()  # fed part of the chunk: start again below
    if hasher is not None:
        hasher.update(np.ascontiguousarray(new.read(start, stop)))
    if base_hasher is not None:
        base_hasher.update(np.ascontiguousarray(base.read(start, stop)))
    idx = new.changed(base, start, stop)
    k, n = int(idx.size), stop - start
    if k == 0:
        return None, 0
    best: EncodedChunk | None = None
    if k <= SPARSE_MAX_FRACTION * n:
        changed_vals = new.gather(start, idx)
        best = encode_sparse(chunk, idx, base.gather(start, idx), changed_vals, level)
        if advance_base and k < XOR_MIN_FRACTION * n:
            base.scatter(start, idx, changed_vals)
            return best, k
    if k >= XOR_MIN_FRACTION * n:
        new_vals = new.read(start, stop)
        xor = encode_dense(chunk, new_vals ^ base.read(start, stop), XOR, level)
        if best is None or xor.nbytes < best.nbytes:
            best = xor
        raw = encode_dense(chunk, new_vals, RAW, level)
        if raw.nbytes < best.nbytes:
            best = raw
        if advance_base:
            base.write(start, new_vals)
    assert best is not None
    return best, k


def decode_sparse(
    rec: ChunkRecord, frames: list[memoryview], n: int, itemsize: int, where: str
) -> tuple[np.ndarray, np.ndarray]:
    """(positions relative to the chunk start, signed differences mod 2^bits)."""
    return decode_streams(decompress_sparse(rec, frames, n, itemsize, where), itemsize)


def decode_sparse_reference(
    rec: ChunkRecord, frames: list[memoryview], n: int, itemsize: int, where: str
) -> tuple[np.ndarray, np.ndarray]:
    """decode_sparse in whole-array numpy operations: the definition the kernels match."""
    gw, ew, k = rec.gap_width, rec.value_width, rec.count
    ng = sparse_gap_frames(rec, frames, n, itemsize, where)
    gaps = _decode_gaps(gw, frames[:ng], k, where)
    idx = np.cumsum(gaps.astype(np.int64) + 1) - 1
    if k and idx[-1] >= n:
        raise IntegrityError(f"{where}: change position {int(idx[-1])} beyond chunk of {n}")
    packed = _decompress_planes([frames[ng]], (k + 3) // 4, 1, where)
    v = unpack_small(packed, k).astype(UINT_BY_WIDTH[itemsize])
    if ew:
        esc = v == 3
        v[esc] += _decompress_planes(frames[ng + 1 :], int(np.count_nonzero(esc)), itemsize, where)
    elif k and int(v.max()) >= 3:
        raise IntegrityError(f"{where}: escape codes without an escape stream")
    return idx, unzigzag(v + v.dtype.type(1))


def decode_dense(
    rec: ChunkRecord, frames: list[memoryview], n: int, itemsize: int, where: str
) -> np.ndarray:
    if rec.count != n or len(frames) != itemsize:
        raise IntegrityError(f"{where}: dense chunk of {rec.count} elements, expected {n}")
    return _decompress_planes(frames, n, itemsize, where)


def apply_record(cur: np.ndarray, rec: ChunkRecord, frames: list[memoryview], where: str) -> None:
    """Turn `cur` (the chunk's bit patterns at the base version) into the new version."""
    n, w = cur.size, cur.itemsize
    if rec.mode == SPARSE:
        apply_streams(cur, decompress_sparse(rec, frames, n, w, where))
    elif rec.mode == XOR:
        cur ^= decode_dense(rec, frames, n, w, where)
    elif rec.mode == RAW:
        cur[:] = decode_dense(rec, frames, n, w, where)
    else:
        raise IntegrityError(f"{where}: unknown chunk mode {rec.mode}")
