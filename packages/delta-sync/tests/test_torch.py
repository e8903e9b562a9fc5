"""Torch users: tensors back as torch bit for bit, and one-line errors naming the tensor
for what cannot be diffed (meta device, unsupported dtypes)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import tandem.delta_sync as ds
from tandem.delta_sync import DeltaSyncError, Publisher, Subscriber, decode_full, encode_full

torch = pytest.importorskip("torch")

DTYPES = ["bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "int64", "bool"]


def _special(dtype: str) -> np.ndarray:
    """Every bit pattern of the narrow types (NaN payloads, -0.0, subnormals, inf)."""
    rng = np.random.default_rng(0)
    if dtype == "bool":
        return rng.integers(0, 2, 64).astype(bool)
    width = np.dtype(getattr(ml_dtypes, dtype, None) or dtype).itemsize
    if width <= 2:
        raw = np.arange(1 << (8 * width), dtype=f"u{width}")
    else:
        raw = rng.integers(0, 1 << 62, 4096, dtype=np.uint64).astype(f"u{width}")
    return raw.view(np.dtype(getattr(ml_dtypes, dtype, None) or dtype)).reshape(-1, 16)


def _bits(t) -> np.ndarray:
    width = t.element_size()
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width]
    return t.contiguous().view(ints).numpy().view(f"u{width}").reshape(-1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_to_torch_is_bit_exact(dtype) -> None:
    arr = _special(dtype)
    t = ds.to_torch(arr)
    assert t.dtype == getattr(torch, dtype) and tuple(t.shape) == arr.shape
    assert np.array_equal(_bits(t), np.ascontiguousarray(arr).reshape(-1).view(f"u{arr.itemsize}"))


def test_materialize_and_decode_full_as_torch(local_store) -> None:
    state = {d: _special(d) for d in DTYPES}
    embed = state["bfloat16"]
    state["tied"] = embed
    Publisher(local_store).publish(0, state)
    for out in (
        Subscriber(local_store).materialize(as_torch=True),
        decode_full(encode_full(state), as_torch=True),
    ):
        assert set(out) == set(state)
        for name, arr in state.items():
            assert isinstance(out[name], torch.Tensor)
            assert out[name].dtype == getattr(torch, name if name in DTYPES else "bfloat16")
            assert np.array_equal(_bits(out[name]), arr.reshape(-1).view(f"u{arr.itemsize}"))
        assert out["tied"].data_ptr() == out["bfloat16"].data_ptr()  # still tied


def test_meta_tensor_is_refused_naming_it(local_store) -> None:
    state = {"ok": torch.zeros(4), "model.layers.0.mlp.weight": torch.empty(4, 4, device="meta")}
    with pytest.raises(DeltaSyncError, match=r"'model.layers.0.mlp.weight'.*meta") as e:
        Publisher(local_store).publish(0, state)
    assert "\n" not in str(e.value)
    with pytest.raises(DeltaSyncError, match=r"'model.layers.0.mlp.weight'.*meta"):
        encode_full(state)


@pytest.mark.parametrize("library", ["torch", "numpy"])
def test_unsupported_dtype_is_refused_naming_the_tensor(local_store, library) -> None:
    bad = torch.zeros(3, dtype=torch.complex64) if library == "torch" else np.zeros(3, "c8")
    with pytest.raises(DeltaSyncError) as e:
        Publisher(local_store).publish(0, {"rotary.freqs": bad})
    msg = str(e.value)
    assert "'rotary.freqs'" in msg and "complex64" in msg and "\n" not in msg
    assert "upgrade" not in msg  # no newer version would take it: cast it instead
