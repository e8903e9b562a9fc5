"""Must-hold 2: Triton kernels are batch-invariant and match torch, under the interpreter.

The interpreter flag has to be set before the kernels are decorated, so the checks run in a
child process with TRITON_INTERPRET=1; this process's environment is untouched.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).with_name("triton_interpreter_checks.py")


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=1800
    )


def test_triton_kernels_under_interpreter() -> None:
    proc = _run()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "OK triton interpreter checks passed" in proc.stdout


@pytest.mark.slow
def test_triton_kernels_under_interpreter_every_batch_size() -> None:
    proc = _run("--full")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "OK triton interpreter checks passed" in proc.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_kernels_batch_invariant_on_gpu(dtype: torch.dtype) -> None:
    from tandem.moe_determinism import ops

    dev = "cuda"
    a = torch.randn(64, 512, device=dev).to(dtype)
    w = torch.randn(384, 512, device=dev).to(dtype)
    x = torch.randn(64, 32000, device=dev).to(dtype)
    full_lin, full_lsm, full_rms = ops.linear(a, w), ops.log_softmax(x, -1), ops.rms_norm(x, None)
    for m in range(1, 65):
        assert torch.equal(ops.linear(a[:m], w), full_lin[:m])
        assert torch.equal(ops.log_softmax(x[:m], -1), full_lsm[:m])
        assert torch.equal(ops.rms_norm(x[:m], None), full_rms[:m])
    q = torch.randn(2, 8, 300, 64, device=dev).to(dtype)
    k, v = (torch.randn(2, 2, 300, 64, device=dev).to(dtype) for _ in range(2))
    full = ops.attention(q, k, v, kv_split_size=64)
    for pos in (0, 63, 64, 200, 299):
        dec = ops.attention(
            q[:, :, pos : pos + 1], k[:, :, : pos + 1], v[:, :, : pos + 1], kv_split_size=64
        )
        assert torch.equal(dec[:, :, 0], full[:, :, pos])
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(full_lin.float(), (a.float() @ w.float().t()), **tol)
