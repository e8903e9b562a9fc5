"""The sparse chunk encoding through the compiled kernels: scan and encode a chunk, then
decompress and check it, and patch (and hash) a chunk with it.

Byte-identical to the whole-array numpy definition in `chunk` (encode_sparse,
decode_sparse_reference), which the tests hold these to. A chunk is scanned and patched
in parts of SCAN_PART_BYTES, each hashed right after, while it is still in a core's cache,
so neither publishing nor applying a delta reads the model from memory a second time to
compute the digests of the new version. `warm_up` readies the kernels ahead of first use.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from typing import Any

import msgspec
import numpy as np
import xxhash

from tandem.delta_sync.codec.frames import (
    SPARSE,
    XOR_MIN_FRACTION,
    ChunkRecord,
    EncodedChunk,
    _cctx,
    _compress_planes,
    _decompress_planes,
    _plane,
    _width_of,
    sparse_gap_frames,
)
from tandem.delta_sync.dtypes import UINT_BY_WIDTH
from tandem.delta_sync.errors import IntegrityError

_local = threading.local()

# A part of a chunk scanned and hashed at a time: it and its base fit in a core's L2 cache.
SCAN_PART_BYTES = 256 << 10


class _ScanBuffers:
    """Per-thread buffers for one chunk's sparse streams, reused chunk after chunk."""

    def __init__(self, limit: int, itemsize: int) -> None:
        uint = UINT_BY_WIDTH[itemsize]
        self.limit = limit
        self.glow = np.empty(limit + 1, np.uint8)
        self.ghigh = np.empty(limit + 1, np.uint32)
        self.vpacked = np.empty(limit // 4 + 1, np.uint8)
        self.vesc = np.empty(limit + 1, uint)
        self.hpacked = np.empty(limit // 4 + 1, np.uint8)
        self.hesc = np.empty(limit + 1, np.uint32)


def _scan_buffers(limit: int, itemsize: int) -> _ScanBuffers:
    cache = getattr(_local, "scan", None)
    if cache is None:
        cache = _local.scan = {}
    buf = cache.get(itemsize)
    if buf is None or buf.limit < limit:
        buf = cache[itemsize] = _ScanBuffers(limit, itemsize)
    return buf


def sparse_limit(n: int) -> int:
    """The most changed elements for which sparse is the only candidate worth trying."""
    return max(0, math.ceil(XOR_MIN_FRACTION * n) - 1)


def encode_sparse_scan(
    chunk: int,
    new: np.ndarray,
    old: np.ndarray,
    level: int,
    *,
    advance: bool = False,
    hasher: Any = None,
    base_hasher: Any = None,
) -> tuple[EncodedChunk | None, int]:
    """(sparse encoding of new against old, changed elements) through the compiled kernels.

    Byte-identical to encode_sparse over the changed positions. Returns (None, -1) when
    more than sparse_limit(n) elements changed (old is then untouched; the caller tries
    the dense encodings), and (None, 0) for an unchanged chunk. With `advance`, old becomes
    new wherever it changed.

    The chunk is scanned in parts of SCAN_PART_BYTES; `hasher` (an xxh3 state), if given,
    is fed each part of `new` right after its scan, while it is still in cache, so the
    chunk's digest costs no second read of it from memory (xxh3 fed part by part equals
    xxh3 of the whole; only complete when the result is not -1). `base_hasher` is fed
    each part of `old` the same way (not with `advance`, which changes it).
    """
    if advance and base_hasher is not None:
        raise ValueError("base_hasher needs the base as it was: not with advance")
    from tandem.delta_sync.codec import kernels  # numba: imported on first use

    limit = sparse_limit(new.size)
    b = _scan_buffers(limit, new.itemsize)
    scan = kernels.sparse_scan_advance if advance else kernels.sparse_scan
    state = np.zeros(6, np.uint64)
    step = max(64, SCAN_PART_BYTES // new.itemsize // 64 * 64)
    for s in range(0, max(new.size, 1), step):
        part = new[s : s + step]
        if scan(part, old[s : s + step], s, limit, b.glow, b.ghigh, b.vpacked, b.vesc, state) < 0:
            if advance:
                kernels.sparse_restore(new, old, int(state[0]), b.glow, b.ghigh, b.vpacked, b.vesc)
            return None, -1
        if hasher is not None:
            hasher.update(part)
        if base_hasher is not None:
            base_hasher.update(old[s : s + step])
    k, ne, gmax = int(state[0]), int(state[1]), int(state[3])
    if k == 0:
        return None, 0
    emax = int(state[4]) - 3 if ne else 0
    cctx = _cctx(level)
    frames = [cctx.compress(b.glow[:k].data)]
    gw = 1
    if gmax >= 256:
        hpacked = b.hpacked[: (k + 3) // 4]
        nh, hmax = kernels.pack_small(b.ghigh[:k], hpacked, b.hesc)
        hw = _width_of(hmax) if nh else 0
        frames.append(cctx.compress(hpacked.data))
        if hw:
            frames += _compress_planes(b.hesc[:nh], hw, level)
        gw = 2 + hw
    ew = _width_of(emax) if ne else 0
    frames.append(cctx.compress(b.vpacked[: (k + 3) // 4].data))
    if ew:
        frames += _compress_planes(b.vesc[:ne], ew, level)
    return EncodedChunk(chunk, SPARSE, int(k), gw, ew, frames), int(k)


class SparseStreams(msgspec.Struct, frozen=True):
    """A sparse chunk decompressed and checked, ready to patch (see kernels.sparse_apply).

    About 1.3 bytes per change at Adam-like deltas, against 6 or more for positions and
    differences, and patching from it reads each change once.
    """

    glow: np.ndarray  # low byte of each gap
    hpacked: np.ndarray  # high parts of the gaps as 2-bit codes (empty: every gap < 256)
    hesc: np.ndarray  # their escapes (uint32), padded by one
    vpacked: np.ndarray  # zigzag(difference) - 1 as 2-bit codes
    vesc: np.ndarray  # their escapes, padded by one

    @property
    def count(self) -> int:
        return int(self.glow.size)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.glow, self.hpacked, self.hesc, self.vpacked, self.vesc))


def decompress_sparse(
    rec: ChunkRecord, frames: list[memoryview], n: int, itemsize: int, where: str
) -> SparseStreams:
    """Decompress and check a sparse chunk of n elements; raises IntegrityError if malformed.

    After this, every position lies inside the chunk, so patching cannot fail midway.
    """
    from tandem.delta_sync.codec import kernels  # numba: imported on first use

    gw, ew, k = rec.gap_width, rec.value_width, rec.count
    ng = sparse_gap_frames(rec, frames, n, itemsize, where)
    packed_len = (k + 3) // 4
    glow = _plane(frames[0], k, where)
    hpacked = np.frombuffer(b"", np.uint8)  # read-only like the planes: one compiled variant
    hesc = np.zeros(1, np.uint32)
    if gw >= 2:
        hpacked = _plane(frames[1], packed_len, where)
        nh = kernels.count_escapes(hpacked, k) if gw > 2 else 0
        hesc = _decompress_planes(frames[2:gw], nh, 4, where, pad=1)
    vpacked = _plane(frames[ng], packed_len, where)
    ne = kernels.count_escapes(vpacked, k)
    if ne and not ew:
        raise IntegrityError(f"{where}: escape codes without an escape stream")
    vesc = _decompress_planes(frames[ng + 1 :], ne if ew else 0, itemsize, where, pad=1)
    last = kernels.sparse_last(glow, hpacked, hesc)
    if last >= n:
        raise IntegrityError(f"{where}: change position {last} beyond chunk of {n}")
    return SparseStreams(glow, hpacked, hesc, vpacked, vesc)


def decode_streams(s: SparseStreams, itemsize: int) -> tuple[np.ndarray, np.ndarray]:
    """(positions relative to the chunk start, differences mod 2^bits) of checked streams."""
    from tandem.delta_sync.codec import kernels  # numba: imported on first use

    idx = np.empty(s.count, np.uint32)
    diff = np.empty(s.count, UINT_BY_WIDTH[itemsize])
    kernels.sparse_decode(s.glow, s.hpacked, s.hesc, s.vpacked, s.vesc, idx, diff)
    return idx, diff


def apply_streams(cur: np.ndarray, s: SparseStreams, *, negate: bool = False) -> None:
    """cur (one chunk's bit patterns) += the streams' differences (-= with negate)."""
    from tandem.delta_sync.codec import kernels  # numba: imported on first use

    if not kernels.sparse_apply(cur, s.glow, s.hpacked, s.hesc, s.vpacked, s.vesc, negate):
        raise IntegrityError(f"sparse patch of {s.count} changes reaches past {cur.size}")


def apply_streams_hashed(cur: np.ndarray, streams: list[SparseStreams], hasher: Any) -> None:
    """cur += each of the streams' differences, in order, part by part: every part of cur
    is patched by all of them, then fed to `hasher` (an xxh3 state) while still in cache.

    The same result as apply_streams for each in turn (each change touches one element,
    so patching part by part commutes with patching stream by stream), and the same digest
    as hashing cur afterwards (xxh3 fed part by part equals xxh3 of the whole), without
    reading cur from memory a second time.
    """
    from tandem.delta_sync.codec import kernels  # numba: imported on first use

    states = [np.zeros(4, np.uint64) for _ in streams]
    step = max(64, SCAN_PART_BYTES // cur.itemsize)
    for s in range(0, max(cur.size, 1), step):
        end = min(s + step, cur.size)
        for st, sp in zip(states, streams, strict=True):
            kernels.sparse_apply_part(
                cur, sp.glow, sp.hpacked, sp.hesc, sp.vpacked, sp.vesc, st, end
            )
        hasher.update(cur[s:end])
    for st, sp in zip(states, streams, strict=True):
        if int(st[0]) != sp.count:
            raise IntegrityError(f"sparse patch of {sp.count} changes reaches past {cur.size}")


def warm_up(itemsizes: Iterable[int] = (1, 2, 4, 8)) -> None:
    """Compile (or load from numba's disk cache) the sparse kernels for these element widths
    now, through the same calls a publish and a pull make: e.g. in a background thread at
    start-up, so that neither the first publish nor the first apply (an engine's pause) pays
    for it. Each width round-trips a small delta and checks it."""
    for width in itemsizes:
        uint = UINT_BY_WIDTH[width].type
        old = (np.arange(4096) * 37).astype(uint)
        new = old.copy()
        new[:2000:7] += uint(1)  # mostly +-1 differences, a few escapes
        new[:2000:91] += uint(5)
        new[3100] += uint(1)  # a long gap: the high part of the gaps and its escapes
        read_only = old.copy()
        read_only.setflags(write=False)
        for base, advance in ((read_only, False), (old.copy(), True)):
            enc, k = encode_sparse_scan(0, new, base, 1, advance=advance)
            if enc is None or k != int(np.count_nonzero(new != old)):
                raise AssertionError(f"warm-up: the {width}-byte scan found {k} changes")
        frames = [memoryview(f) for f in enc.frames]
        rec = ChunkRecord(
            0, 0, enc.mode, enc.count, enc.gap_width, enc.value_width, [len(f) for f in frames]
        )
        streams = decompress_sparse(rec, frames, old.size, width, "warm-up")
        patched, hashed = old.copy(), old.copy()
        apply_streams(patched, streams)
        hasher = xxhash.xxh3_128()
        apply_streams_hashed(hashed, [streams], hasher)  # what an apply runs on host memory
        idx, _ = decode_streams(streams, width)
        if not np.array_equal(patched, new) or idx.size != enc.count:
            raise AssertionError(f"warm-up: the {width}-byte round trip is not exact")
        if not np.array_equal(hashed, new) or hasher.digest() != xxhash.xxh3_128_digest(new):
            raise AssertionError(f"warm-up: the {width}-byte hashed patch is not exact")
