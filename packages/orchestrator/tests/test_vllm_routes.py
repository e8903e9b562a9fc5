"""What the vLLM engine does with the experts vLLM reports, and the settings that make vLLM
report them and compute batch-invariantly on CUDA (checked here without a server; the GPU
run itself is `test_vllm_gpu.py`)."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import msgspec
import numpy as np
import pytest
from vllm_helpers import ENGINE, MODEL

from tandem.moe_determinism import MoETransformer
from tandem.moe_determinism.model.hf import save_hf
from tandem.orchestrator.inference.vllm.engine import VllmEngine
from tandem.orchestrator.inference.vllm.errors import VllmReplyMismatch
from tandem.orchestrator.inference.vllm.server import server_command, server_env


def _encoded(routes: np.ndarray) -> str:
    """As vLLM sends them: the `.npy` bytes, base64."""
    buffer = io.BytesIO()
    np.save(buffer, routes, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode()


def _engine(moe_layers: list[int]) -> VllmEngine:
    return VllmEngine(
        ["http://127.0.0.1:1"],
        ENGINE,
        stop_id=7,
        vocab=266,
        model_vocab=266,
        route_shape=(len(moe_layers), 2),
        moe_layers=moe_layers,
    )


def test_the_turns_rows_of_the_moe_layers_are_kept() -> None:
    """vLLM's rows cover the request's whole context and every layer (dense ones too);
    a turn keeps its own new rows of the MoE layers, in order."""
    rng = np.random.default_rng(0)
    every = rng.integers(0, 8, size=(30, 4, 2)).astype(np.uint8)  # 4 layers, 1 and 3 MoE
    engine = _engine([1, 3])
    got = engine._routes(_encoded(every), before=10, rows=12)
    assert got.dtype == np.int16 and got.shape == (12, 2, 2)
    assert np.array_equal(got, every[10:22][:, [1, 3]].astype(np.int16))
    only_moe = every[:, [1, 3]]  # a server that reports the MoE layers alone
    assert np.array_equal(engine._routes(_encoded(only_moe), 10, 12), got)
    unknown = engine._routes(None, 10, 12)
    assert unknown.shape == (12, 2, 2) and (unknown == -1).all()


def test_routes_that_do_not_fit_the_policy_are_an_error() -> None:
    engine = _engine([0, 1])
    rows = np.zeros((20, 2, 2), dtype=np.uint8)
    with pytest.raises(VllmReplyMismatch, match=r"at least 22 rows"):
        engine._routes(_encoded(rows), before=10, rows=12)
    with pytest.raises(VllmReplyMismatch, match=r"2 MoE layers x 2 experts"):
        engine._routes(_encoded(np.zeros((30, 2, 4), dtype=np.uint8)), 0, 5)


def test_on_cuda_moe_policies_report_routes_and_run_batch_invariant(tmp_path: Path) -> None:
    moe = save_hf(MoETransformer(MODEL), tmp_path / "moe")
    dense_cfg = msgspec.structs.replace(MODEL, model_type="qwen3", intermediate_size=64)
    dense = save_hf(MoETransformer(dense_cfg), tmp_path / "dense")
    assert json.loads((dense / "config.json").read_text()).get("num_experts", 0) == 0
    py = Path("python")
    flag = "--enable-return-routed-experts"
    assert flag in server_command(py, moe, ENGINE, 1, 0, cuda=True)
    assert flag not in server_command(py, dense, ENGINE, 1, 0, cuda=True)  # vLLM refuses it
    assert flag not in server_command(py, moe, ENGINE, 1, 0, cuda=False)  # no capture on CPU
    assert server_env(ENGINE, cuda=True)["VLLM_BATCH_INVARIANT"] == "1"
    loose = msgspec.structs.replace(ENGINE, deterministic=False)
    assert "VLLM_BATCH_INVARIANT" not in server_env(loose, cuda=True)
    assert "VLLM_BATCH_INVARIANT" not in server_env(ENGINE, cuda=False)  # no such CPU kernels
