"""Bit-exact round trips of the codec and the in-memory blob API."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.delta_sync import (
    BaseMismatchError,
    DeltaSyncError,
    IntegrityError,
    apply_delta,
    decode_full,
    encode_delta,
    encode_full,
)
from tandem.delta_sync.codec.chunk import (
    encode_chunk,
    encode_dense,
    encode_sparse,
    pack_small,
    unpack_small,
    unzigzag,
    zigzag,
)
from tandem.delta_sync.codec.frames import MODE_NAMES, RAW, SPARSE_MAX_FRACTION, XOR
from tandem.delta_sync.tensors import view_of

DTYPES = [
    np.dtype(ml_dtypes.bfloat16),
    np.dtype(np.float16),
    np.dtype(np.float32),
    np.dtype(ml_dtypes.float8_e4m3fn),
    np.dtype(ml_dtypes.float8_e5m2),
    np.dtype(np.int8),
    np.dtype(np.uint8),
    np.dtype(np.int32),
    np.dtype(np.int64),
]


def _specials(dtype: np.dtype) -> np.ndarray:
    """Bit patterns of -0.0, +-inf, NaNs with payloads, subnormals, extremes."""
    u = f"u{dtype.itemsize}"
    vals = [0, np.iinfo(u).max, np.iinfo(u).max // 2, 1, np.iinfo(u).max // 2 + 1]
    if dtype.kind == "V" or dtype.kind == "f":
        f = np.array([-0.0, np.inf, -np.inf, np.nan], np.float32).astype(dtype)
        vals += f.view(u).tolist()
    return np.array(vals, dtype=u)


@st.composite
def pairs(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 40), min_size=0, max_size=3)))
    n = int(np.prod(shape, dtype=np.int64))
    seed = draw(st.integers(0, 2**32 - 1))
    density = draw(st.sampled_from([0.0, 0.01, 0.1, 0.3, 0.7, 1.0]))
    kind = draw(st.sampled_from(["ulp", "random", "special"]))
    rng = np.random.default_rng(seed)
    u = np.dtype(f"u{dtype.itemsize}")
    base = rng.integers(0, np.iinfo(u).max, n, dtype=u, endpoint=True)
    if n:
        base[rng.random(n) < 0.1] = rng.choice(_specials(dtype), size=1)
    new = base.copy()
    mask = rng.random(n) < density
    k = int(mask.sum())
    if kind == "ulp":
        new[mask] += rng.choice(np.array([1, np.iinfo(u).max, 2, 3], u), size=k)
    elif kind == "random":
        new[mask] = rng.integers(0, np.iinfo(u).max, k, dtype=u, endpoint=True)
    else:
        new[mask] = rng.choice(_specials(dtype), size=k)
    chunk_bytes = draw(st.sampled_from([8, 64, 1000, 1 << 20]))
    return (
        base.view(dtype).reshape(shape),
        new.view(dtype).reshape(shape),
        chunk_bytes,
    )


def _eq(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pairs(), st.integers(1, 3))
def test_delta_round_trip_is_bit_exact(pair, workers) -> None:
    base, new, chunk_bytes = pair
    empty = np.zeros((0, 3), base.dtype)  # an empty tensor rides along in every state
    blob = encode_delta({"t": base, "e": empty}, {"t": new, "e": empty}, chunk_bytes=chunk_bytes)
    target = {"t": base.copy(), "e": empty.copy()}
    apply_delta(target, blob, workers=workers)
    assert _eq(target["t"], new)


@settings(max_examples=40, deadline=None)
@given(pairs())
def test_full_round_trip_is_bit_exact(pair) -> None:
    _, new, chunk_bytes = pair
    out = decode_full(encode_full({"x": new}, chunk_bytes=chunk_bytes))
    assert _eq(out["x"], new)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([1, 2, 4, 8]), st.lists(st.integers(-300, 300), max_size=50))
def test_zigzag_inverts_and_maps_small_differences_to_small_codes(width, diffs) -> None:
    u = np.dtype(f"u{width}")
    d = np.array(diffs, np.int64).astype(f"i{width}").view(u)
    z = zigzag(d)
    assert np.array_equal(unzigzag(z), d)
    # independent formula: 2|x| - (x < 0)
    x = np.array(diffs, np.int64).astype(f"i{width}").astype(np.int64)
    assert np.array_equal(
        z.astype(np.int64) if width < 8 else z.view(np.int64), 2 * np.abs(x) - (x < 0)
    )


@given(st.lists(st.integers(0, 2**16 - 1), max_size=99))
def test_pack_small_round_trip(values) -> None:
    v = np.array(values, np.uint16)
    packed, escapes = pack_small(v)
    low = unpack_small(packed, v.size).astype(np.uint16)
    low[low == 3] += escapes
    assert np.array_equal(low, v)
    assert packed.size == (v.size + 3) // 4


def test_each_mode_is_chosen_where_it_is_smallest() -> None:
    rng = np.random.default_rng(1)
    base = rng.normal(0, 0.02, 1 << 16).astype(ml_dtypes.bfloat16)
    b = view_of("b", base)
    seen = set()
    for density, kind in [(0, "ulp"), (0.02, "ulp"), (0.3, "ulp"), (0.6, "noise"), (1, "reset")]:
        bits = base.view(np.uint16).copy()
        mask = rng.random(bits.size) < density
        bits[mask] += np.uint16(1)
        if kind == "noise":
            bits[mask] ^= rng.integers(0, 2**16, int(mask.sum()), dtype=np.uint16)
        if kind == "reset":
            bits[:] = 0x3F80  # every weight reset to 1.0
        n = view_of("n", bits.view(ml_dtypes.bfloat16))
        enc, changed = encode_chunk(n, b, 0, bits.size, 1)
        assert changed == int(np.count_nonzero(bits != base.view(np.uint16)))
        if enc is None:
            assert changed == 0
            seen.add("unchanged")
            continue
        seen.add(MODE_NAMES[enc.mode])
        # an independent size for every candidate that could apply
        idx = np.flatnonzero(bits != base.view(np.uint16))
        sizes = {
            "xor": encode_dense(0, bits ^ base.view(np.uint16), XOR, 1).nbytes,
            "raw": encode_dense(0, bits, RAW, 1).nbytes,
        }
        if idx.size <= SPARSE_MAX_FRACTION * bits.size:
            old = base.view(np.uint16)[idx]
            sizes["sparse"] = encode_sparse(0, idx, old, bits[idx], 1).nbytes
        assert enc.nbytes <= min(sizes.values()), (density, enc.mode, sizes)
    assert seen == {"unchanged", "sparse", "xor", "raw"}


def test_adam_like_step_is_mostly_one_ulp_and_compresses(trainer) -> None:
    base = trainer.snapshot()
    new = trainer.step(2e-6)
    blob = encode_delta(base, new)
    dense = sum(a.nbytes for a in new.values())
    changed = sum(int((base[k].view(np.uint16) != new[k].view(np.uint16)).sum()) for k in new)
    assert 0 < changed < 0.2 * dense / 2
    # each changed element costs well under the 4 bytes a (position, value) pair would take
    assert len(blob) < 2 * changed


def test_wrong_base_raises_and_changes_nothing(trainer, same_bits) -> None:
    v0 = trainer.snapshot()
    v1 = trainer.step()
    v2 = trainer.step()
    blob = encode_delta(v1, v2)
    target = {k: a.copy() for k, a in v0.items()}
    with pytest.raises(BaseMismatchError, match="base"):
        apply_delta(target, blob)
    same_bits(target, v0)


def test_corrupt_blob_raises_integrity_error(trainer, same_bits) -> None:
    v0 = trainer.snapshot()
    v1 = trainer.step()
    blob = bytearray(encode_delta(v0, v1))
    blob[len(blob) // 2] ^= 0xFF
    target = {k: a.copy() for k, a in v0.items()}
    with pytest.raises(DeltaSyncError):
        apply_delta(target, bytes(blob))
    same_bits(target, v0)
    with pytest.raises(IntegrityError):
        apply_delta(target, b"nonsense")


def test_bad_inputs_give_clear_errors(trainer) -> None:
    v0 = trainer.snapshot()
    with pytest.raises(DeltaSyncError, match="tensor set changed"):
        encode_delta(v0, {**v0, "extra": np.zeros(3, np.float32)})
    with pytest.raises(DeltaSyncError, match="changed from"):
        encode_delta(v0, {**v0, "embed": v0["embed"].astype(np.float32)})
    with pytest.raises(DeltaSyncError, match="unsupported dtype"):
        encode_full({"c": np.zeros(3, np.complex64)})
    with pytest.raises(DeltaSyncError, match="expected a numpy array, a torch tensor"):
        encode_full({"l": [1, 2, 3]})
    blob = encode_delta(v0, trainer.step())
    fortran = {k: np.asfortranarray(a) if a.ndim > 1 else a.copy() for k, a in v0.items()}
    with pytest.raises(DeltaSyncError, match="C-contiguous"):
        apply_delta(fortran, blob)
    with pytest.raises(DeltaSyncError, match="no tensor"):
        apply_delta({"embed": v0["embed"].copy()}, blob)


def test_torch_cpu_tensors_round_trip_in_place(trainer, same_bits) -> None:
    torch = pytest.importorskip("torch")
    v0, v1 = trainer.snapshot(), trainer.step()
    t0 = {k: torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16) for k, a in v0.items()}
    t1 = {k: torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16) for k, a in v1.items()}
    blob = encode_delta(t0, t1)
    live = {k: t.clone() for k, t in t0.items()}
    ptrs = {k: t.data_ptr() for k, t in live.items()}
    apply_delta(live, blob)
    same_bits(live, t1)
    assert {k: t.data_ptr() for k, t in live.items()} == ptrs  # patched in place
    # numpy and torch produce the same blob for the same bits
    assert encode_delta(v0, v1) == blob
