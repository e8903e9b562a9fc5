"""Per-chunk encoding of one tensor's change: the smallest of unchanged/sparse/XOR/raw.

A chunk is a fixed run of elements of one tensor, handled as unsigned bit patterns.

* sparse: positions of the changed elements as gaps (zero-based distance to the previous
  change) and the zig-zag of (new - old) mod 2^bits. Adam at RL learning rates moves most
  changed bf16 weights by one ulp, so the differences are mostly 1 or 2 after zig-zag;
  they are stored as 2-bit codes packed four per byte plus an escape stream (pack_small).
* xor: new ^ old for every element (wins when most elements change a little).
* raw: the new bit patterns (anchors, or a chunk unrelated to its base).

Each integer stream is split into byte planes (low byte first) and every plane is one zstd
frame: the planes have very different statistics, and zstd's literal coder builds one
Huffman table per block, so planes sharing a block would share a table. Compression and
decompression are one-shot calls, which release the GIL, so chunks encode in parallel.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from typing import Any

import msgspec
import numpy as np
import xxhash
import zstandard

from tandem.delta_sync.dtypes import INT_BY_WIDTH, UINT_BY_WIDTH
from tandem.delta_sync.errors import IntegrityError
from tandem.delta_sync.tensors import HostTensor, TensorView

UNCHANGED, SPARSE, XOR, RAW = 0, 1, 2, 3
MODE_NAMES = {UNCHANGED: "unchanged", SPARSE: "sparse", XOR: "xor", RAW: "raw"}

# Candidates worth trying, by changed fraction: below 20% changed neither XOR nor raw has
# come close to sparse on any state we measured, and above 50% sparse cannot win.
SPARSE_MAX_FRACTION = 0.5
XOR_MIN_FRACTION = 0.2

_local = threading.local()

# A part of a chunk scanned and hashed at a time: it and its base fit in a core's L2 cache.
SCAN_PART_BYTES = 256 << 10


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


def _gap_frames(gap_width: int) -> int:
    return 1 if gap_width == 1 else gap_width


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
) -> tuple[EncodedChunk | None, int]:
    """(sparse encoding of new against old, changed elements) through the compiled kernels.

    Byte-identical to encode_sparse over the changed positions. Returns (None, -1) when
    more than sparse_limit(n) elements changed (old is then untouched; the caller tries
    the dense encodings), and (None, 0) for an unchanged chunk. With `advance`, old becomes
    new wherever it changed.

    The chunk is scanned in parts of SCAN_PART_BYTES; `hasher` (an xxh3 state), if given,
    is fed each part of `new` right after its scan, while it is still in cache, so the
    chunk's digest costs no second read of it from memory (xxh3 fed part by part equals
    xxh3 of the whole; only complete when the result is not -1).
    """
    from tandem.delta_sync import kernels  # numba: imported on first use

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
) -> tuple[EncodedChunk | None, int]:
    """(smallest encoding of chunk `chunk` of `new` against `base`, changed elements).

    The encoding is None for an unchanged chunk. Without a base (an anchor) the chunk is
    stored raw. With `advance_base`, the base chunk is then overwritten with the new bits
    (only the changed elements when they are few), so a publisher's copy of the previous
    version becomes the new one without copying the whole model every step. `hasher`, if
    given, is a fresh xxh3 state, fed exactly this chunk of `new` by the time this returns
    (during the scan when the sparse kernels run).
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
        )
        if k >= 0:
            return enc, k
        if hasher is not None:
            hasher.reset()  # fed part of the chunk: start again below
    if hasher is not None:
        hasher.update(np.ascontiguousarray(new.read(start, stop)))
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


def split_frames(rec: ChunkRecord, body: memoryview) -> list[memoryview]:
    out, pos = [], 0
    for n in rec.frames:
        out.append(body[pos : pos + n])
        pos += n
    return out


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


def _plane(frame: memoryview, size: int, where: str) -> np.ndarray:
    try:
        data = _dctx().decompress(frame, max_output_size=max(size, 1))
    except zstandard.ZstdError as e:
        raise IntegrityError(f"{where}: corrupt zstd frame ({e})") from None
    if len(data) != size:
        raise IntegrityError(f"{where}: plane has {len(data)} bytes, expected {size}")
    return np.frombuffer(data, np.uint8)


def decompress_sparse(
    rec: ChunkRecord, frames: list[memoryview], n: int, itemsize: int, where: str
) -> SparseStreams:
    """Decompress and check a sparse chunk of n elements; raises IntegrityError if malformed.

    After this, every position lies inside the chunk, so patching cannot fail midway.
    """
    from tandem.delta_sync import kernels  # numba: imported on first use

    gw, ew, k = rec.gap_width, rec.value_width, rec.count
    if not 1 <= gw <= 6 or ew > itemsize or k > n:
        raise IntegrityError(f"{where}: malformed sparse chunk (widths {gw}/{ew}, {k} of {n})")
    ng = _gap_frames(gw)
    if len(frames) != ng + 1 + ew:
        raise IntegrityError(f"{where}: malformed sparse chunk ({len(frames)} frames)")
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
    from tandem.delta_sync import kernels  # numba: imported on first use

    idx = np.empty(s.count, np.uint32)
    diff = np.empty(s.count, UINT_BY_WIDTH[itemsize])
    kernels.sparse_decode(s.glow, s.hpacked, s.hesc, s.vpacked, s.vesc, idx, diff)
    return idx, diff


def apply_streams(cur: np.ndarray, s: SparseStreams, *, negate: bool = False) -> None:
    """cur (one chunk's bit patterns) += the streams' differences (-= with negate)."""
    from tandem.delta_sync import kernels  # numba: imported on first use

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
    from tandem.delta_sync import kernels  # numba: imported on first use

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
    if not 1 <= gw <= 6 or ew > itemsize or k > n:
        raise IntegrityError(f"{where}: malformed sparse chunk (widths {gw}/{ew}, {k} of {n})")
    ng = _gap_frames(gw)
    if len(frames) != ng + 1 + ew:
        raise IntegrityError(f"{where}: malformed sparse chunk ({len(frames)} frames)")
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
