"""Compiled single-pass loops for the sparse chunk encoding (numba, GIL released).

The sparse encoding is defined in `chunk` with whole-array numpy operations; those need a
full-chunk compare, `np.flatnonzero`, two gathers and a dozen passes over the changed
elements, which held encoding near 0.5 GB/s per core. These loops produce byte-identical
streams in one pass over the chunk (compare, gap, zig-zag, 2-bit packing and escapes
together), and decode them in one pass over the changed elements. They release the GIL,
so chunks encode and decode in parallel on the thread pool.

All arithmetic is done in uint64 and masked to the element width, so one source serves
uint8/16/32/64 bit patterns (numba compiles one specialisation per width on first use and
caches it on disk).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

_ZERO = np.uint64(0)
_ONE = np.uint64(1)
_TWO = np.uint64(2)
_THREE = np.uint64(3)
_U32 = np.uint64(0xFFFFFFFF)


@intrinsic
def _cttz(typingctx, x):
    """Count of trailing zero bits of a nonzero uint64 (one instruction: tzcnt/bsf)."""
    sig = types.uint64(types.uint64)

    def codegen(context, builder, signature, args):
        return builder.cttz(args[0], ir.Constant(ir.IntType(1), 0))

    return sig, codegen


@intrinsic
def _ctpop(typingctx, x):
    """Number of set bits of a uint64 (one instruction: popcnt)."""
    sig = types.uint64(types.uint64)

    def codegen(context, builder, signature, args):
        return builder.ctpop(args[0])

    return sig, codegen


@intrinsic
def _ne_mask64(typingctx, a, b, start):
    """Bit j set where a[start + j] != b[start + j] for j < 64: one compare of two
    64-element vectors whose result is read as a 64-bit mask (LLVM lowers this to the
    target's vector compare and mask extraction). a and b are C-contiguous arrays of one
    dtype with at least start + 64 elements (not checked)."""
    if not (a.layout == b.layout == "C" and a.dtype == b.dtype and a.ndim == b.ndim == 1):
        return None  # a typing error, never a wrong mask
    sig = types.uint64(a, b, start)

    def codegen(context, builder, signature, args):
        aty, bty, _ = signature.args
        pa = context.make_array(aty)(context, builder, args[0]).data
        pb = context.make_array(bty)(context, builder, args[1]).data
        vty = ir.VectorType(ir.IntType(aty.dtype.bitwidth), 64).as_pointer()
        va = builder.load(builder.bitcast(builder.gep(pa, [args[2]]), vty), align=1)
        vb = builder.load(builder.bitcast(builder.gep(pb, [args[2]]), vty), align=1)
        return builder.bitcast(builder.icmp_unsigned("!=", va, vb), ir.IntType(64))

    return sig, codegen


@numba.njit(nogil=True, cache=True)
def sparse_restore(new, old, k, glow, ghigh, vpacked, vesc):
    """Undo the advance of the first k changes of a chunk: old = new - difference at each."""
    mask = np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - new.itemsize * 8)
    pos = _ZERO
    vi = _ZERO
    for j in range(np.uint64(k)):
        pos += np.uint64(glow[j]) | (np.uint64(ghigh[j]) << np.uint64(8))
        vc = (np.uint64(vpacked[j >> _TWO]) >> ((j & _THREE) << _ONE)) & _THREE
        v = vc
        if vc == _THREE:
            v = (_THREE + np.uint64(vesc[vi])) & mask
            vi += _ONE
        zz = (v + _ONE) & mask
        d = ((zz >> _ONE) ^ (_ZERO - (zz & _ONE))) & mask
        old[pos] = (np.uint64(new[pos]) - d) & mask
        pos += _ONE


@numba.njit(nogil=True, cache=True, inline="always")
def _scan(new, old, offset, limit, glow, ghigh, vpacked, vesc, state, advance):
    """Find the changed elements of part of a chunk and write their sparse streams, in one
    pass; a chunk is scanned part after part (each hashed while still in cache).

    new, old: elements [offset, offset + new.size) of the chunk's bit patterns (same
    unsigned dtype, C-contiguous). For the j-th changed element of the chunk, with gap =
    elements skipped since the previous change and v = zigzag(new - old) - 1 (>= 0: a
    changed element has a nonzero difference): glow[j] = gap & 255, ghigh[j] = gap >> 8,
    2-bit code min(v, 3) at j in vpacked (four to a byte, low bits first, the last byte
    zero padded), and the escapes v - 3 of the v >= 3, in order, in vesc. These are exactly
    chunk.encode_sparse's streams before compression, so nothing is read again to pack
    them. With `advance` (a constant in each compiled variant), old becomes new wherever it
    changed. glow, ghigh and vesc hold limit + 1 values, vpacked limit // 4 + 1 bytes.
    state carries [changes, escapes, next position, largest gap, largest v, code byte] from
    one part to the next (zeros before the first).

    The part is compared 64 elements at a time into a bit mask whose set bits are then
    visited, so unchanged stretches cost a vector compare and no mispredicted branch; the
    limit is checked once per block, with a popcount. Every store is unconditional (an
    escape slot is written for every change and kept only for escapes). Indices are
    unsigned so that no negative-index handling is compiled in.

    Returns the changes so far, or -1 as soon as more than `limit` elements changed: the
    changes advanced before are then still advanced (see sparse_restore).
    """
    n = np.uint64(new.size)
    bits = np.uint64(new.itemsize * 8)
    mask = np.uint64(0xFFFFFFFFFFFFFFFF) >> (np.uint64(64) - bits)
    top = bits - _ONE
    lim = np.uint64(limit)
    off = np.uint64(offset)
    k, ne, nxt, gmax, vmax, byte = state[0], state[1], state[2], state[3], state[4], state[5]
    nfull = n // np.uint64(64)
    for blk in range(nfull + _ONE):
        base = np.uint64(blk) * np.uint64(64)
        if blk < nfull:
            m = _ne_mask64(new, old, base)
        else:
            m = _ZERO
            for j in range(n - base):
                u = np.uint64(j)
                m |= np.uint64(new[base + u] != old[base + u]) << u
        if k + _ctpop(m) > lim:
            if k & _THREE:
                vpacked[k >> _TWO] = byte
            state[0] = k
            return np.int64(-1)
        while m:
            i = base + _cttz(m)
            m &= m - _ONE
            gap = off + i - nxt
            nxt = off + i + _ONE
            gmax = max(gmax, gap)
            glow[k] = gap & np.uint64(255)
            ghigh[k] = gap >> np.uint64(8)
            a = np.uint64(new[i])
            d = (a - np.uint64(old[i])) & mask
            v = (((d << _ONE) & mask) ^ ((_ZERO - ((d >> top) & _ONE)) & mask)) - _ONE
            vmax = max(vmax, v)
            vesc[ne] = v - _THREE
            ne += np.uint64(v >= _THREE)
            shift = (k & _THREE) << _ONE
            byte |= min(v, _THREE) << shift
            if shift == np.uint64(6):
                vpacked[k >> _TWO] = byte
                byte = _ZERO
            if advance:
                old[i] = a
            k += _ONE
    if k & _THREE:
        vpacked[k >> _TWO] = byte
    state[0], state[1], state[2], state[3], state[4], state[5] = k, ne, nxt, gmax, vmax, byte
    return np.int64(k)


@numba.njit(nogil=True, cache=True)
def sparse_scan(new, old, offset, limit, glow, ghigh, vpacked, vesc, state):
    """_scan of new against old, which is only read (it may be a read-only array)."""
    return _scan(new, old, offset, limit, glow, ghigh, vpacked, vesc, state, False)


@numba.njit(nogil=True, cache=True)
def sparse_scan_advance(new, old, offset, limit, glow, ghigh, vpacked, vesc, state):
    """_scan of new against old, turning old into new where it changed."""
    return _scan(new, old, offset, limit, glow, ghigh, vpacked, vesc, state, True)


@numba.njit(nogil=True, cache=True)
def pack_small(v, packed, esc):
    """chunk.pack_small in two passes: min(v, 3) packed four 2-bit codes to a byte (low bits
    first, zero padded) into `packed`, then the escapes v - 3 of v >= 3, in order, into esc.

    packed holds (v.size + 3) // 4 bytes, esc v.size + 1 values. The first pass has no
    data-dependent branch or store (it vectorises); the second runs only if some v >= 3,
    and stores every value, keeping it only if it is an escape. Returns (escapes, largest).
    """
    k = np.uint64(v.size)
    nfull = k >> _TWO
    vmax = _ZERO
    for q in range(nfull):
        j = np.uint64(q) << _TWO
        x0 = np.uint64(v[j])
        x1 = np.uint64(v[j + _ONE])
        x2 = np.uint64(v[j + _TWO])
        x3 = np.uint64(v[j + _THREE])
        vmax = max(vmax, max(max(x0, x1), max(x2, x3)))
        packed[q] = (
            min(x0, _THREE)
            | (min(x1, _THREE) << _TWO)
            | (min(x2, _THREE) << np.uint64(4))
            | (min(x3, _THREE) << np.uint64(6))
        )
    if k & _THREE:
        byte = _ZERO
        for r in range(k & _THREE):
            x = np.uint64(v[(nfull << _TWO) + np.uint64(r)])
            vmax = max(vmax, x)
            byte |= min(x, _THREE) << (np.uint64(r) << _ONE)
        packed[nfull] = byte
    ne = _ZERO
    if vmax >= _THREE:
        for j in range(k):
            x = np.uint64(v[j])
            esc[ne] = x - _THREE
            ne += np.uint64(x >= _THREE)
    return np.int64(ne), vmax - _THREE if ne else _ZERO


@numba.njit(nogil=True, cache=True)
def count_escapes(packed, k):
    """How many of the first k 2-bit codes in `packed` are 3 (the escape code).

    A byte at a time: its codes equal to 3 are the set bits of b & (b >> 1) & 0b01010101,
    counted with a popcount, so the loop has no branch and runs over k / 4 bytes (codes
    past k in the last byte are masked off: they do not count, whatever they hold).
    """
    k = np.uint64(k)
    c = _ZERO
    nfull = k >> _TWO
    for q in range(nfull):
        b = np.uint64(packed[q])
        c += _ctpop(b & (b >> _ONE) & np.uint64(0x55))
    r = k & _THREE
    if r:
        b = np.uint64(packed[nfull]) & ((_ONE << (r << _ONE)) - _ONE)
        c += _ctpop(b & (b >> _ONE) & np.uint64(0x55))
    return np.int64(c)


@numba.njit(nogil=True, cache=True, inline="always")
def _change(j, glow, hpacked, hesc, hi, vpacked, vesc, vi, mask):
    """(gap, difference mod 2^bits, next high escape, next value escape) of change j.

    Reads of the escape streams are branch-free: they are padded by one element, and the
    value read is used only when the code is an escape.
    """
    gap = np.uint64(glow[j])
    if hpacked.size:
        hc = (np.uint64(hpacked[j >> _TWO]) >> ((j & _THREE) << _ONE)) & _THREE
        he = (_THREE + np.uint64(hesc[hi])) & _U32
        hi += np.uint64(hc == _THREE)
        gap |= ((he if hc == _THREE else hc) << np.uint64(8)) & _U32
    vc = (np.uint64(vpacked[j >> _TWO]) >> ((j & _THREE) << _ONE)) & _THREE
    ve = (_THREE + np.uint64(vesc[vi])) & mask
    vi += np.uint64(vc == _THREE)
    zz = ((ve if vc == _THREE else vc) + _ONE) & mask
    return gap, (zz >> _ONE) ^ ((_ZERO - (zz & _ONE)) & mask), hi, vi


@numba.njit(nogil=True, cache=True)
def sparse_last(glow, hpacked, hesc):
    """Position of the last change (relative to the chunk start), -1 if there is none.

    Without a high part every gap is its low byte, so the position is a plain sum (a
    vectorised loop); with one, the gaps are decoded change by change as patching does.
    """
    pos = _ZERO
    if not hpacked.size:
        for j in range(glow.size):
            pos += np.uint64(glow[j])
        return np.int64(pos + np.uint64(glow.size)) - 1
    hi = _ZERO
    for j in range(np.uint64(glow.size)):
        gap = np.uint64(glow[j])
        hc = (np.uint64(hpacked[j >> _TWO]) >> ((j & _THREE) << _ONE)) & _THREE
        he = (_THREE + np.uint64(hesc[hi])) & _U32
        hi += np.uint64(hc == _THREE)
        gap |= ((he if hc == _THREE else hc) << np.uint64(8)) & _U32
        pos += gap + _ONE
    return np.int64(pos) - 1


@numba.njit(nogil=True, cache=True)
def sparse_decode(glow, hpacked, hesc, vpacked, vesc, idx, diff):
    """Positions (relative to the chunk start) and differences mod 2^bits of the changes.

    The streams must have been checked with sparse_last (positions inside the chunk).
    """
    mask = np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - diff.itemsize * 8)
    pos = _ZERO
    hi = _ZERO
    vi = _ZERO
    for j in range(np.uint64(glow.size)):
        gap, d, hi, vi = _change(j, glow, hpacked, hesc, hi, vpacked, vesc, vi, mask)
        pos += gap
        idx[j] = pos
        diff[j] = d
        pos += _ONE


@numba.njit(nogil=True, cache=True)
def sparse_apply(seg, glow, hpacked, hesc, vpacked, vesc, negate):
    """seg[position] += difference (or -= with `negate`) for every change, mod 2^bits.

    Decodes and patches in one pass, without materialising positions or differences.
    Returns False, having written nothing past seg, if a position falls outside seg.
    """
    mask = np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - seg.itemsize * 8)
    n = np.uint64(seg.size)
    pos = _ZERO
    hi = _ZERO
    vi = _ZERO
    for j in range(np.uint64(glow.size)):
        gap, d, hi, vi = _change(j, glow, hpacked, hesc, hi, vpacked, vesc, vi, mask)
        pos += gap
        if pos >= n:
            return False
        if negate:
            d = (_ZERO - d) & mask
        seg[pos] = np.uint64(seg[pos]) + d
        pos += _ONE
    return True


@numba.njit(nogil=True, cache=True)
def sparse_apply_part(seg, glow, hpacked, hesc, vpacked, vesc, state, stop):
    """sparse_apply for the changes at positions below `stop` not applied yet, so a chunk
    is patched part after part (each hashed while still in cache).

    state carries [changes applied, position after the last one, high escapes used, value
    escapes used] from one part to the next (zeros before the first). The streams must
    have been checked with sparse_last and stop must not exceed seg.size. Returns the
    changes applied so far.
    """
    mask = np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - seg.itemsize * 8)
    end = np.uint64(stop)
    j, pos, hi, vi = state[0], state[1], state[2], state[3]
    while j < np.uint64(glow.size):
        gap, d, hj, vj = _change(j, glow, hpacked, hesc, hi, vpacked, vesc, vi, mask)
        p = pos + gap
        if p >= end:
            break
        seg[p] = np.uint64(seg[p]) + d
        pos, hi, vi = p + _ONE, hj, vj
        j += _ONE
    state[0], state[1], state[2], state[3] = j, pos, hi, vi
    return np.int64(j)


@numba.njit(nogil=True, cache=True)
def scatter_add(seg, idx, diff):
    """seg[idx] += diff modulo 2^bits (idx checked against seg by the caller)."""
    for j in range(idx.size):
        seg[idx[j]] += diff[j]
