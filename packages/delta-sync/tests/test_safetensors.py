"""The public safetensors API: metadata kept, offsets checked, torch tensors in and out."""

from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np
import pytest

import tandem.delta_sync as ds
from tandem.delta_sync import DeltaSyncError


def _state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "w": rng.normal(0, 0.02, (30, 20)).astype(ml_dtypes.bfloat16),
        "b": rng.normal(0, 1, (20,)).astype(np.float32),
        "q": np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn),
        "steps": np.arange(5, dtype=np.int64),
    }


def _write_raw(path, header: dict, data: bytes) -> None:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def test_round_trip_keeps_metadata_and_bits(tmp_path, same_bits) -> None:
    state = _state()
    path = tmp_path / "m.safetensors"
    ds.save_safetensors(path, state, metadata={"format": "pt", "step": "7"})
    tensors, metadata = ds.load_safetensors(path)
    same_bits(tensors, state)
    assert metadata == {"format": "pt", "step": "7"}
    st = pytest.importorskip("safetensors")
    with st.safe_open(str(path), "np") as f:  # the reference reader sees the same metadata
        assert f.metadata() == {"format": "pt", "step": "7"}
    ds.save_safetensors(path, state)
    assert ds.load_safetensors(path)[1] == {}


def test_torch_tensors_in_and_out(tmp_path, same_bits) -> None:
    torch = pytest.importorskip("torch")
    embed = torch.randn(16, 8).to(torch.bfloat16)
    state = {"embed": embed, "lm_head": embed, "scale": torch.ones(3, dtype=torch.float16)}
    path = tmp_path / "t.safetensors"
    ds.save_safetensors(path, state, metadata={"tied": "lm_head=embed"})
    tensors, metadata = ds.load_safetensors(path, as_torch=True)
    assert all(isinstance(t, torch.Tensor) for t in tensors.values())
    assert tensors["embed"].dtype == torch.bfloat16 and metadata["tied"] == "lm_head=embed"
    same_bits(tensors, state)
    st_torch = pytest.importorskip("safetensors.torch")
    same_bits(st_torch.load_file(str(path)), state)  # the reference library reads it
    with pytest.raises(DeltaSyncError, match=r"'ghost'.*meta"):
        ds.save_safetensors(path, {"ghost": torch.empty(2, device="meta")})


def test_truncated_data_names_the_file_and_the_tensor(tmp_path) -> None:
    path = tmp_path / "cut.safetensors"
    ds.save_safetensors(path, _state())
    data = path.read_bytes()
    path.write_bytes(data[:-10])  # the last tensor in the file ('w') lost its end
    with pytest.raises(DeltaSyncError, match=r"cut\.safetensors: tensor 'w'.*truncated") as e:
        ds.load_safetensors(path)
    assert "\n" not in str(e.value)
    path.write_bytes(data[:20])  # cut inside the header
    with pytest.raises(DeltaSyncError, match="truncated"):
        ds.load_safetensors(path)


def test_bad_offsets_are_refused(tmp_path) -> None:
    f32 = {"dtype": "F32", "shape": [2]}
    cases = {
        "overlap": (
            {"a": {**f32, "data_offsets": [0, 8]}, "b": {**f32, "data_offsets": [4, 12]}},
            r"'a' and 'b' overlap",
        ),
        "range": ({"a": {**f32, "data_offsets": [8, 16]}}, r"'a' ends at byte 16.*truncated"),
        "reversed": ({"a": {**f32, "data_offsets": [8, 0]}}, r"'a': bad data_offsets"),
        "length": ({"a": {**f32, "data_offsets": [0, 4]}}, r"'a': data_offsets span 4 bytes"),
    }
    for label, (header, pattern) in cases.items():
        path = tmp_path / f"{label}.safetensors"
        _write_raw(path, header, bytes(12))
        with pytest.raises(DeltaSyncError, match=pattern):
            ds.load_safetensors(path)


def test_missing_file_and_unsupported_dtype(tmp_path) -> None:
    with pytest.raises(DeltaSyncError, match="no such file"):
        ds.load_safetensors(tmp_path / "nope.safetensors")
    path = tmp_path / "c.safetensors"
    _write_raw(path, {"freqs": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, bytes(8))
    with pytest.raises(DeltaSyncError, match=r"'freqs': unsupported dtype C64 \(complex64\)"):
        ds.load_safetensors(path)
