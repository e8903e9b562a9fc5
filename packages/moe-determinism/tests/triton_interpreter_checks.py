"""Triton kernels under the interpreter (fp32): batch invariance and agreement with torch.

Run as a script with TRITON_INTERPRET=1 set *before* Triton is imported (the kernels are
decorated at import). `test_triton_kernels.py` runs it in a subprocess so the flag never
leaks into other tests. Exits non-zero with a message on the first failure.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F


def _fail(msg: str) -> None:
    print(f"FAIL: {msg}")
    sys.exit(1)


def _rows_invariant(name: str, fn, x: torch.Tensor, rows: range) -> None:
    full = fn(x)
    for m in rows:
        if not torch.equal(fn(x[:m]), full[:m]):
            _fail(
                f"{name}: rows of a batch of {m} differ from the same rows in a batch of {x.shape[0]}"
            )


def main() -> None:
    """`--full`: every batch size 1..64 (minutes in the interpreter); default: a spread of
    batch sizes around the tile edges (about a minute)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        _fail("set TRITON_INTERPRET=1 before running this script")
    full_run = "--full" in sys.argv
    from tandem.moe_determinism import ops
    from tandem.moe_determinism.kernels import triton_kernels as tk

    gen = torch.Generator().manual_seed(0)
    rows = range(1, 65) if full_run else [1, 2, 3, 15, 16, 17, 33, 64]
    row_rows = range(1, 65) if full_run else [1, 2, 5, 16]
    # matmul / bmm
    a, w = torch.randn(64, 40, generator=gen), torch.randn(40, 24, generator=gen)
    _rows_invariant("matmul", lambda t: tk.matmul(t, w), a, rows)
    torch.testing.assert_close(tk.matmul(a, w), a @ w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tk.matmul(a, w), ops.mm(a, w), rtol=1e-5, atol=1e-5)
    a3, b3 = torch.randn(3, 40, 20, generator=gen), torch.randn(3, 20, 17, generator=gen)
    full = tk.matmul(a3, b3)
    for m in (1, 17) if not full_run else (1, 7, 16, 33):
        if not torch.equal(tk.matmul(a3[:, :m], b3), full[:, :m]):
            _fail(f"bmm: rows differ for m={m}")
    torch.testing.assert_close(full, torch.bmm(a3, b3), rtol=1e-5, atol=1e-5)
    # row kernels
    for n in (37, 300):
        x = torch.randn(64 if full_run else 16, n, generator=gen)
        wt = torch.rand(n, generator=gen) + 0.5
        _rows_invariant(f"rms_norm[{n}]", lambda t, wt=wt: tk.rms_norm(t, wt, 1e-6), x, row_rows)
        _rows_invariant(f"log_softmax[{n}]", tk.log_softmax, x, row_rows)
        _rows_invariant(f"row_sum[{n}]", tk.row_sum, x, row_rows)
        torch.testing.assert_close(
            tk.rms_norm(x, wt, 1e-6), ops.rms_norm(x, wt, 1e-6), rtol=1e-5, atol=1e-6
        )
        torch.testing.assert_close(tk.log_softmax(x), ops.log_softmax(x, -1), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tk.row_sum(x), x.sum(-1), rtol=1e-5, atol=1e-4)
    # attention: prefill vs cached decode vs batch, GQA, against the torch op and SDPA
    b, hq, hkv, t, d = 2, 4, 2, 40, 16
    q = torch.randn(b, hq, t, d, generator=gen)
    k, v = torch.randn(b, hkv, t, d, generator=gen), torch.randn(b, hkv, t, d, generator=gen)

    def attn(q_, k_, v_, qpos=None, kvlen=None):
        bb, _, tq, _ = q_.shape
        kvlen = torch.full((bb,), k_.shape[2]) if kvlen is None else kvlen
        qpos = kvlen[:, None] - tq + torch.arange(tq)[None] if qpos is None else qpos
        return tk.attention(q_, k_, v_, True, 16, qpos, kvlen, d**-0.5)

    full = attn(q, k, v)
    ref = F.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True
    )
    torch.testing.assert_close(full, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(full, ops.attention(q, k, v, kv_split_size=16), rtol=1e-5, atol=1e-5)
    for pos in (0, 1, 15, 16, 17, 31, 39) if full_run else (0, 16, 39):
        dec = attn(q[:, :, pos : pos + 1], k[:, :, : pos + 1], v[:, :, : pos + 1])
        if not torch.equal(dec[:, :, 0], full[:, :, pos]):
            _fail(f"attention: decode at position {pos} differs from prefill")
        alone = attn(
            q[1:, :, pos : pos + 1], k[1:], v[1:], torch.tensor([[pos]]), torch.tensor([pos + 1])
        )
        if not torch.equal(alone[:, :, 0], full[1:, :, pos]):
            _fail(f"attention: batch of one at position {pos} differs")
    print("OK triton interpreter checks passed")


if __name__ == "__main__":
    main()
