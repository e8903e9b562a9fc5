"""Under `batch_invariant()`, a row's bits do not depend on the batch it is in, its position
there, or the thread count: swept over shapes (M up to 80, K up to 8192, odd N and N whose
rows are 64-byte multiples, written straight into the output), fp32 and
bf16 and 1 to `os.cpu_count()` threads (at least 2) with hypothesis. The examples are
derandomized: every run draws the same ones, so the test cannot flake on a draw."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.moe_determinism import batch_invariant, ops
from tandem.moe_determinism.ops import workers
from tandem.moe_determinism.ops.gemm import fixed_shape_bmm

MAX_THREADS = max(2, os.cpu_count() or 1)
K_VALUES = [1, 7, 64, 511, 512, 513, 1000, 4096, 8192]
N_VALUES = st.one_of(
    st.integers(0, 40).map(lambda x: 2 * x + 1), st.sampled_from([16, 48, 512, 528])
)


def _with_threads(n: int, fn):
    """`fn()` on `n` torch threads; with several, the workers share every product of more
    than one tile job (by default only large ones), so the sweep's shapes reach them."""
    before, shared = torch.get_num_threads(), workers.SHARED_WORK
    torch.set_num_threads(n)
    workers.SHARED_WORK = 0 if n > 1 else shared
    try:
        return fn()
    finally:
        torch.set_num_threads(before)
        workers.SHARED_WORK = shared


def _operands(m: int, k: int, n: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    return a, w


@settings(max_examples=24, deadline=None, derandomize=True)
@given(
    m=st.integers(1, 80),
    k=st.sampled_from(K_VALUES),
    n=N_VALUES,
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    threads=st.integers(1, MAX_THREADS),
    data=st.data(),
)
def test_linear_rows_invariant_to_batch_position_and_threads(
    m: int, k: int, n: int, dtype: torch.dtype, threads: int, data: st.DataObject
) -> None:
    a, w = _operands(m, k, n, dtype, seed=m * 10007 + k)
    lo = data.draw(st.integers(0, m - 1), label="lo")
    hi = data.draw(st.integers(lo + 1, m), label="hi")
    with batch_invariant():
        reference = _with_threads(1, lambda: F.linear(a, w))

        def run():
            return F.linear(a, w), F.linear(a[lo:hi], w), torch.mm(a[lo : lo + 1], w.t())

        full, part, alone = _with_threads(threads, run)
    assert torch.equal(full, reference), f"{threads} threads vs 1"
    assert torch.equal(part, reference[lo:hi]), f"rows {lo}:{hi} of {m}"
    assert torch.equal(alone, reference[lo : lo + 1]), f"row {lo} alone"
    # an independent computation: the values are the product's
    tol = (
        dict(rtol=3e-2, atol=3e-2 * k**0.5)
        if dtype == torch.bfloat16
        else dict(rtol=1e-4, atol=1e-4 * k**0.5)
    )
    torch.testing.assert_close(full.double(), F.linear(a.double(), w.double()), **tol)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    g=st.integers(1, 6),
    m=st.integers(1, 40),
    k=st.sampled_from([3, 64, 600, 2048]),
    n=st.integers(0, 30).map(lambda x: 2 * x + 1),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    threads=st.integers(1, MAX_THREADS),
)
def test_bmm_rows_invariant_to_batch_and_threads(
    g: int, m: int, k: int, n: int, dtype: torch.dtype, threads: int
) -> None:
    gen = torch.Generator().manual_seed(g * 1000 + m)
    a = torch.randn(g, m, k, generator=gen).to(dtype)
    b = torch.randn(g, k, n, generator=gen).to(dtype)
    reference = _with_threads(1, lambda: ops.bmm(a, b))
    cut = max(1, m // 3)
    full, part, first = _with_threads(
        threads, lambda: (ops.bmm(a, b), ops.bmm(a[:, cut:], b), ops.bmm(a[:1, :1], b[:1]))
    )
    assert torch.equal(full, reference)
    assert torch.equal(part, reference[:, cut:])
    assert torch.equal(first, reference[:1, :1])


@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    m=st.integers(1, 24),
    width=st.sampled_from([5, 64, 1000, 40001]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    threads=st.integers(1, MAX_THREADS),
)
def test_row_ops_invariant_to_batch_and_threads(
    m: int, width: int, dtype: torch.dtype, threads: int
) -> None:
    x = torch.randn(m, width, generator=torch.Generator().manual_seed(width + m)).to(dtype)
    fns = {
        "log_softmax": lambda t: ops.log_softmax(t, -1),
        "softmax": lambda t: ops.softmax(t, -1),
        "rms_norm": lambda t: ops.rms_norm(t, None),
        "mean": lambda t: ops.mean(t, -1),
        "silu": ops.silu,
    }
    for name, fn in fns.items():
        reference = _with_threads(1, lambda fn=fn: fn(x))
        got = _with_threads(threads, lambda fn=fn: (fn(x), fn(x[m - 1 :])))
        assert torch.equal(got[0], reference), name
        assert torch.equal(got[1], reference[m - 1 :]), name


@settings(max_examples=16, deadline=None, derandomize=True)
@given(
    p=st.integers(1, 40),
    k=st.sampled_from([1, 7, 32, 64, 511, 600]),
    n=st.sampled_from([1, 5, 16, 32, 64, 77]),
    transposed=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    threads=st.integers(1, MAX_THREADS),
    data=st.data(),
)
def test_fixed_shape_items_invariant_to_company_place_and_threads(
    p: int,
    k: int,
    n: int,
    transposed: bool,
    dtype: torch.dtype,
    threads: int,
    data: st.DataObject,
) -> None:
    """`fixed_shape_bmm` runs its items in batched calls of a fixed count: an item's bits do
    not depend on how many items come with it, on its place among them (other windows, the
    zero-padded short batch) or on the thread count; the transposed operand is what
    attention passes (keys)."""
    gen = torch.Generator().manual_seed(p * 131 + k * 7 + n)
    a = torch.randn(p, 16, k, generator=gen).to(dtype)
    b = torch.randn(p, n, k, generator=gen).to(dtype)
    b = b.transpose(1, 2) if transposed else b.transpose(1, 2).contiguous()
    reference = _with_threads(1, lambda: fixed_shape_bmm(a, b))
    perm = torch.tensor(data.draw(st.permutations(range(p)), label="perm"))
    i = data.draw(st.integers(0, p - 1), label="i")
    shuffled, alone = _with_threads(
        threads,
        lambda: (fixed_shape_bmm(a[perm], b[perm]), fixed_shape_bmm(a[i : i + 1], b[i : i + 1])),
    )
    assert torch.equal(shuffled, reference[perm]), f"{threads} threads, items reordered"
    assert torch.equal(alone, reference[i : i + 1]), f"item {i} alone"
    tol = (
        dict(rtol=3e-2, atol=3e-2 * k**0.5)
        if dtype == torch.bfloat16
        else dict(rtol=1e-4, atol=1e-4 * k**0.5)
    )
    torch.testing.assert_close(reference.double(), a.double() @ b.double(), **tol)
