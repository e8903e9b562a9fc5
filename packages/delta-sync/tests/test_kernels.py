"""The compiled sparse kernels against the whole-array numpy definition of the format."""

from __future__ import annotations

import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.delta_sync import IntegrityError, apply_delta, encode_delta
from tandem.delta_sync.codec import sparse
from tandem.delta_sync.codec.chunk import (
    decode_sparse,
    decode_sparse_reference,
    encode_chunk,
    encode_sparse,
    unpack_small,
)
from tandem.delta_sync.codec.frames import ChunkRecord, EncodedChunk
from tandem.delta_sync.codec.sparse import (
    SparseStreams,
    apply_streams,
    apply_streams_hashed,
    decompress_sparse,
    encode_sparse_scan,
    sparse_limit,
)

FLOATS = {
    1: [ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2],
    2: [ml_dtypes.bfloat16, np.float16],
    4: [np.float32],
    8: [np.float64],
}


def _specials(width: int) -> np.ndarray:
    """Bit patterns of -0.0, +-inf, NaNs (quiet, signalling, with payloads), subnormals."""
    u = np.dtype(f"u{width}")
    top = 1 << (8 * width - 1)
    vals = {0, top, 1, top | 1, 2, np.iinfo(u).max, np.iinfo(u).max - 1, top - 1}
    for dt in FLOATS[width]:
        f = np.array([-0.0, np.inf, -np.inf, np.nan, -np.nan], np.float32).astype(dt)
        vals.update(f.view(u).tolist())
        info = ml_dtypes.finfo(dt)
        tiny = np.array([info.smallest_subnormal, -info.smallest_subnormal], dt)
        vals.update(tiny.view(u).tolist())
    return np.array(sorted(vals), u)


@st.composite
def chunks(draw):
    """(old, new) bit patterns of one chunk: Adam-like +-1 ulp steps, wider steps, special
    values, random replacements; sizes around the 64-element blocks; gaps past 256 and 768
    so every escape stream is exercised."""
    width = draw(st.sampled_from([1, 2, 4, 8]))
    u = np.dtype(f"u{width}")
    n = draw(st.sampled_from([1, 3, 63, 64, 65, 127, 129, 1000, 5000, 20000]))
    density = draw(st.sampled_from([0.0, 0.0005, 0.003, 0.02, 0.1, 0.19, 0.25]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    specials = _specials(width)
    old = rng.integers(0, np.iinfo(u).max, n, dtype=u, endpoint=True)
    old[rng.random(n) < 0.05] = rng.choice(specials)
    new = old.copy()
    mask = rng.random(n) < density
    k = int(mask.sum())
    steps = np.array([1, np.iinfo(u).max, 2, np.iinfo(u).max - 1, 3, 7, 300 % (1 << 8 * width)], u)
    new[mask] = old[mask] + rng.choice(steps, k)
    pick = mask & (rng.random(n) < 0.1)
    new[pick] = rng.choice(specials, int(pick.sum()))
    pick = mask & (rng.random(n) < 0.05)
    new[pick] = rng.integers(0, np.iinfo(u).max, int(pick.sum()), dtype=u, endpoint=True)
    return old, new


def _reference(old: np.ndarray, new: np.ndarray) -> EncodedChunk | None:
    idx = np.flatnonzero(new != old)
    if not idx.size:
        return None
    return encode_sparse(0, idx, old[idx], new[idx], 1)


def _record(enc: EncodedChunk) -> tuple[ChunkRecord, list[memoryview]]:
    rec = ChunkRecord(
        0, enc.chunk, enc.mode, enc.count, enc.gap_width, enc.value_width,
        [len(f) for f in enc.frames],
    )  # fmt: skip
    return rec, [memoryview(f) for f in enc.frames]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunks(), st.booleans(), st.sampled_from([256 << 10, 128, 1000]))
def test_scan_matches_the_numpy_encoding_byte_for_byte(chunk, advance, part_bytes) -> None:
    old, new = chunk
    k_true = int(np.count_nonzero(new != old))
    base = old.copy()
    saved, sparse.SCAN_PART_BYTES = sparse.SCAN_PART_BYTES, part_bytes
    try:
        enc, k = encode_sparse_scan(0, new, base, 1, advance=advance)
    finally:
        sparse.SCAN_PART_BYTES = saved
    if k_true > sparse_limit(new.size):
        assert (enc, k) == (None, -1)
        assert np.array_equal(base, old)  # left (or put back) exactly as it was
        return
    assert k == k_true
    assert enc == _reference(old, new)
    assert np.array_equal(base, new if advance else old)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunks())
def test_compiled_decode_and_patch_match_the_numpy_decoder(chunk) -> None:
    old, new = chunk
    enc = _reference(old, new)
    if enc is None:
        return
    rec, frames = _record(enc)
    w = old.itemsize
    idx_ref, diff_ref = decode_sparse_reference(rec, frames, old.size, w, "t")
    idx, diff = decode_sparse(rec, frames, old.size, w, "t")
    assert np.array_equal(idx, idx_ref) and diff.dtype == diff_ref.dtype
    assert np.array_equal(diff, diff_ref)
    streams = decompress_sparse(rec, frames, old.size, w, "t")
    cur = old.copy()
    apply_streams(cur, streams)
    assert cur.tobytes() == new.tobytes()
    apply_streams(cur, streams, negate=True)
    assert cur.tobytes() == old.tobytes()


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_every_special_value_transition_round_trips(width) -> None:
    """Each special pattern to each other one (sign flips of zero, NaN payload changes,
    subnormal to normal), sparse among unchanged elements."""
    s = _specials(width)
    a, b = np.meshgrid(s, s)
    keep = a != b
    n = 97 * keep.sum()
    old = np.zeros(n, s.dtype)
    new = old.copy()
    pos = np.arange(keep.sum()) * 97 + 13
    old[pos], new[pos] = a[keep], b[keep]
    enc, k = encode_sparse_scan(0, new, old.copy(), 1)
    assert k == pos.size and enc == _reference(old, new)
    cur = old.copy()
    apply_streams(cur, decompress_sparse(*_record(enc), n, width, "t"))
    assert cur.tobytes() == new.tobytes()


def test_malformed_sparse_streams_raise_before_writing() -> None:
    old = np.zeros(4000, np.uint16)
    new = old.copy()
    new[[5, 900, 3999]] = [1, 0xFFFF, 7]
    rec, frames = _record(encode_sparse_scan(0, new, old.copy(), 1)[0])
    with pytest.raises(IntegrityError, match="beyond chunk"):
        decompress_sparse(rec, frames, 3999, 2, "t")
    fields = [getattr(rec, f) for f in rec.__struct_fields__]
    no_escapes = ChunkRecord(*fields[:5], 0, rec.frames[:-1])  # drop the escape plane
    with pytest.raises(IntegrityError, match="escape"):
        decompress_sparse(no_escapes, frames[:-1], 4000, 2, "t")
    with pytest.raises(IntegrityError, match="frames"):
        decompress_sparse(rec, frames[:-1], 4000, 2, "t")


def test_read_only_states_encode_and_the_base_is_never_written() -> None:
    rng = np.random.default_rng(1)
    base = rng.integers(0, 2**16, 300_000, dtype=np.uint16).view(ml_dtypes.bfloat16)
    new = base.copy()
    new.view(np.uint16)[rng.random(base.size) < 0.03] += np.uint16(1)
    for a in (base, new):
        a.flags.writeable = False
    blob = encode_delta({"w": base}, {"w": new}, chunk_bytes=1 << 16)
    target = {"w": base.copy()}
    apply_delta(target, blob)
    assert target["w"].tobytes() == new.tobytes()


def test_base_digests_hashed_during_the_scan_equal_a_separate_pass() -> None:
    from tandem.delta_sync.delta import _unpack
    from tandem.delta_sync.tensors import chunk_elems_for, tensor_digest, views_of

    rng = np.random.default_rng(2)
    base = {
        "a": rng.integers(0, 2**16, (300, 70), dtype=np.uint16).view(ml_dtypes.bfloat16),
        "b": rng.standard_normal(5000).astype(np.float32),
    }
    new = {k: v.copy() for k, v in base.items()}
    new["a"].view(np.uint16)[0, :7] += np.uint16(1)
    meta, _ = _unpack(encode_delta(base, new, chunk_bytes=1 << 12))
    views = views_of(base)
    expected = {n: tensor_digest(v, chunk_elems_for(v.itemsize, 1 << 12)) for n, v in views.items()}
    assert {t.name: t.digest for t in meta.base} == expected


@pytest.mark.parametrize("density", [0.0, 0.01, 0.1, 0.6])
def test_base_digests_fed_part_by_part_equal_a_separate_pass(density) -> None:
    """Base digests fed during a scan of many parts (or, past the sparse limit, by the
    dense fallback after a scan that stopped midway) equal xxh3 of each base chunk."""
    from tandem.delta_sync.delta import _unpack
    from tandem.delta_sync.tensors import chunk_elems_for, tensor_digest, views_of

    rng = np.random.default_rng(3)
    base = {"w": rng.integers(0, 2**16, 50_000, dtype=np.uint16).view(ml_dtypes.bfloat16)}
    new = {"w": base["w"].copy()}
    new["w"].view(np.uint16)[rng.random(50_000) < density] += np.uint16(1)
    saved, sparse.SCAN_PART_BYTES = sparse.SCAN_PART_BYTES, 1000
    try:
        blob = encode_delta(base, new, chunk_bytes=1 << 16)
    finally:
        sparse.SCAN_PART_BYTES = saved
    meta, _ = _unpack(blob)
    v = views_of(base)["w"]
    assert meta.base[0].digest == tensor_digest(v, chunk_elems_for(2, 1 << 16))
    assert meta.tensors[0].digest == tensor_digest(views_of(new)["w"], chunk_elems_for(2, 1 << 16))
    target = {"w": base["w"].copy()}
    apply_delta(target, blob)
    assert target["w"].tobytes() == new["w"].tobytes()


def test_warm_up_readies_the_kernels_a_pull_will_call() -> None:
    """In a fresh process no kernel is ready; after warm_up((4,)) the 4-byte patch kernel is
    (compiled, or loaded from numba's cache), and warm_up checked its own round trips."""
    script = (
        "from tandem.delta_sync import warm_up\n"
        "from tandem.delta_sync.codec import kernels\n"
        "before = len(kernels.sparse_apply_part.signatures)\n"
        "warm_up((4,))\n"
        "print(before, [str(s[0]) for s in kernels.sparse_apply_part.signatures])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True
    ).stdout.split(" ", 1)
    assert out[0] == "0"
    assert "uint32" in out[1]


@settings(max_examples=80, deadline=None)
@given(st.binary(min_size=0, max_size=300), st.integers(0, 3))
def test_escape_count_reads_only_the_first_k_codes(data, cut) -> None:
    """The byte-wise count equals a code-by-code count, whatever the padding bits hold."""
    from tandem.delta_sync.codec import kernels

    packed = np.frombuffer(data, np.uint8)
    k = max(0, 4 * packed.size - cut)
    codes = unpack_small(packed, k) if packed.size else np.zeros(0, np.uint8)
    assert kernels.count_escapes(packed, k) == int(np.count_nonzero(codes == 3))


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=0, max_size=2000))
def test_last_position_without_a_high_part_is_the_sum_of_the_gaps(data) -> None:
    from tandem.delta_sync.codec import kernels

    glow = np.frombuffer(data, np.uint8)
    empty = np.frombuffer(b"", np.uint8)
    expected = int(np.sum(glow.astype(np.int64) + 1)) - 1
    assert kernels.sparse_last(glow, empty, np.zeros(1, np.uint32)) == expected


@pytest.mark.parametrize("density", [0.0, 0.01, 0.1, 0.3, 0.9])
@pytest.mark.parametrize("advance", [False, True])
def test_chunk_digest_fed_during_the_scan_equals_a_separate_pass(density, advance) -> None:
    """The digest fed part by part while scanning (or again after the sparse scan gave up
    on a dense chunk) is the one-shot xxh3 of the chunk, in every mode."""
    import xxhash

    from tandem.delta_sync.tensors import chunk_digest, views_of

    rng = np.random.default_rng(3)
    n = 3 * (sparse.SCAN_PART_BYTES // 2) + 77  # several parts and a ragged tail
    old = rng.integers(0, 2**16, n, dtype=np.uint16)
    new = old.copy()
    new[rng.random(n) < density] += np.uint16(1)
    views = views_of(
        {"new": new.view(ml_dtypes.bfloat16), "old": old.copy().view(ml_dtypes.bfloat16)}
    )
    h = xxhash.xxh3_128()
    _, k = encode_chunk(views["new"], views["old"], 0, n, 1, advance_base=advance, hasher=h)
    assert k == int(np.count_nonzero(new != old))
    assert h.digest() == chunk_digest(new)
    assert np.array_equal(views["old"].flat, new if advance else old)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunks(), chunks())
def test_patching_part_by_part_equals_patching_whole_and_hashing(first, second) -> None:
    """Two stacked sparse patches applied part by part give the bits and the digest of
    applying each to the whole chunk and hashing it afterwards."""
    import xxhash

    old, mid = first
    if second[0].dtype != old.dtype or second[0].size != old.size:
        return
    new = mid + (second[1] - second[0])  # a second step over the same chunk
    steps: list[SparseStreams] = []
    for a, b in ((old, mid), (mid, new)):
        enc = _reference(a, b)
        if enc is not None:
            steps.append(decompress_sparse(*_record(enc), old.size, old.itemsize, "t"))
    for part_bytes in (sparse.SCAN_PART_BYTES, 256):  # one part; many, of 64+ elements
        cur = old.copy()
        h = xxhash.xxh3_128()
        saved, sparse.SCAN_PART_BYTES = sparse.SCAN_PART_BYTES, part_bytes
        try:
            apply_streams_hashed(cur, steps, h)
        finally:
            sparse.SCAN_PART_BYTES = saved
        assert cur.tobytes() == new.tobytes()
        assert h.digest() == xxhash.xxh3_128_digest(new.tobytes())
