"""Must-hold 1: every op is bitwise batch-invariant (fp32 and bf16, 1 and 2 threads)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.moe_determinism import ops

DTYPES = [torch.float32, torch.bfloat16]
# (rows, width) shapes: small, odd, and long rows (a vocabulary-sized row is where torch
# splits the reduced dimension across threads).
SHAPES = [
    (64, 37),
    (64, 1000),
    (8, 40000),
    pytest.param((64, 40000), marks=pytest.mark.slow),
]


def _rows_invariant(fn, x: torch.Tensor) -> list[int]:
    """Return the m in 1..64 for which fn(x[:m]) differs from fn(x)[:m]."""
    full = fn(x)
    return [m for m in range(1, x.shape[0] + 1) if not torch.equal(fn(x[:m]), full[:m])]


ROW_OPS = {
    "softmax": lambda t: ops.softmax(t, -1),
    "log_softmax": lambda t: ops.log_softmax(t, -1),
    "mean": lambda t: ops.mean(t, -1),
    "rms_norm": lambda t: ops.rms_norm(t, torch.linspace(0.5, 1.5, t.shape[-1], dtype=t.dtype)),
    "silu": ops.silu,
    "sigmoid": ops.sigmoid,
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_row_ops_are_batch_invariant(
    threads: int, dtype: torch.dtype, shape: tuple[int, int]
) -> None:
    x = torch.randn(
        *shape, generator=torch.Generator().manual_seed(shape[1]), dtype=torch.float32
    ).to(dtype)
    for name, fn in ROW_OPS.items():
        assert _rows_invariant(fn, x) == [], (
            f"{name} not invariant ({dtype}, {shape}, {threads} threads)"
        )


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_ops_give_the_same_bits_with_and_without_a_graph(dtype: torch.dtype) -> None:
    """Without an autograd graph the element-wise ops reuse their fresh intermediates in
    place; with one they may not. Both ways give the same bits, and the graph's gradient is
    torch's formula's (odd width: vector loop tails)."""
    x = (4 * torch.randn(9, 1003, generator=torch.Generator().manual_seed(2))).to(dtype)
    for name, fn in ROW_OPS.items():
        leaf = x.float().requires_grad_()
        graphed = fn(leaf.to(dtype))
        assert graphed.requires_grad
        with torch.no_grad():
            assert torch.equal(fn(x), graphed.detach()), name
        assert torch.equal(fn(x), graphed.detach()), name  # no graph: x needs no gradient
    leaf = x.float().requires_grad_()
    (ops.silu(leaf) * torch.linspace(-1, 1, 1003)).sum().backward()
    ref = x.float().requires_grad_()
    (F.silu(ref) * torch.linspace(-1, 1, 1003)).sum().backward()
    torch.testing.assert_close(leaf.grad, ref.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_ops_match_torch(dtype: torch.dtype) -> None:
    """Independent check: same values as torch's own ops up to rounding."""
    x = torch.randn(16, 3000, dtype=torch.float32).to(dtype)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ops.softmax(x, -1), torch.softmax(x, -1), **tol)
    torch.testing.assert_close(ops.log_softmax(x, -1), torch.log_softmax(x, -1), **tol)
    torch.testing.assert_close(ops.mean(x, -1), x.mean(-1), **tol)
    torch.testing.assert_close(ops.mean(x, (0, 1)), x.mean((0, 1)), **tol)
    torch.testing.assert_close(
        ops.rms_norm(x, None, 1e-6), F.rms_norm(x.float(), (3000,), eps=1e-6).to(dtype), **tol
    )
    torch.testing.assert_close(ops.silu(x), F.silu(x), **tol)
    torch.testing.assert_close(ops.sigmoid(x), torch.sigmoid(x), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_family_is_batch_invariant(threads: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(threads)
    for k, n in [(37, 53), (512, 96)]:
        a = torch.randn(64, k, generator=gen).to(dtype)
        w = torch.randn(n, k, generator=gen).to(dtype)
        bias = torch.randn(n, generator=gen).to(dtype)
        assert _rows_invariant(lambda t, w=w: ops.mm(t, w.t()), a) == []
        assert _rows_invariant(lambda t, w=w, bias=bias: ops.addmm(bias, t, w.t()), a) == []
        assert _rows_invariant(lambda t, w=w, bias=bias: ops.linear(t, w, bias), a) == []
        a3 = torch.randn(3, 64, k, generator=gen).to(dtype)
        b3 = torch.randn(3, k, n, generator=gen).to(dtype)
        full = ops.bmm(a3, b3)
        assert all(torch.equal(ops.bmm(a3[:, :m], b3), full[:, :m]) for m in range(1, 65))
        assert torch.equal(ops.bmm(a3[:1], b3[:1]), full[:1])  # batch count too
        tol = dict(rtol=2e-2, atol=1e-1) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(
            ops.linear(a, w, bias).float(), F.linear(a.float(), w.float(), bias.float()), **tol
        )
        torch.testing.assert_close(full.float(), torch.bmm(a3.float(), b3.float()), **tol)


def test_matmul_same_bits_with_one_and_two_threads() -> None:
    before = torch.get_num_threads()
    a, w = torch.randn(40, 300), torch.randn(200, 300)
    q, k, v = torch.randn(2, 4, 70, 32), torch.randn(2, 2, 70, 32), torch.randn(2, 2, 70, 32)
    x = torch.randn(3, 50000)
    try:
        results = []
        for t in (1, 2):
            torch.set_num_threads(t)
            results.append((ops.linear(a, w), ops.attention(q, k, v), ops.log_softmax(x, -1)))
    finally:
        torch.set_num_threads(before)
    for one, two in zip(*results, strict=True):
        assert torch.equal(one, two)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_invariant_to_batch_queries_and_kv_length(
    threads: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(7)
    b, hq, hkv, t, d = 3, 4, 2, 150, 32
    q, k, v = (torch.randn(b, h, t, d, generator=gen).to(dtype) for h in (hq, hkv, hkv))
    full = ops.attention(q, k, v, causal=True, kv_split_size=32)
    for pos in [0, 1, 31, 32, 33, 64, 100, 149]:
        # One-token decode against a cache holding exactly pos + 1 keys ...
        dec = ops.attention(
            q[:, :, pos : pos + 1], k[:, :, : pos + 1], v[:, :, : pos + 1], kv_split_size=32
        )
        assert torch.equal(dec[:, :, 0], full[:, :, pos]), f"decode differs at {pos}"
        # ... alone in the batch, and against a longer, partly filled cache.
        alone = ops.attention(
            q[1:2, :, pos : pos + 1],
            k[1:2],
            v[1:2],
            kv_split_size=32,
            q_positions=torch.tensor([[pos]]),
            kv_lengths=torch.tensor([pos + 1]),
        )
        assert torch.equal(alone[:, :, 0], full[1:2, :, pos])
    # Chunked prefill: queries 50..89 together against keys 0..89.
    part = ops.attention(q[:, :, 50:90], k[:, :, :90], v[:, :, :90], kv_split_size=32)
    assert torch.equal(part, full[:, :, 50:90])


def test_attention_matches_sdpa() -> None:
    q, k, v = torch.randn(2, 6, 90, 16), torch.randn(2, 3, 90, 16), torch.randn(2, 3, 90, 16)
    ref = F.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True
    )
    torch.testing.assert_close(ops.attention(q, k, v, causal=True), ref, rtol=1e-5, atol=1e-5)
    ref_nc = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    torch.testing.assert_close(ops.attention(q, k, v, causal=False), ref_nc, rtol=1e-5, atol=1e-5)


def test_tree_sum_ignores_trailing_zeros() -> None:
    x = torch.randn(5, 7)
    padded = torch.cat([x, torch.zeros(5, 9)], dim=1)
    assert torch.equal(ops.tree_sum(x, 1), ops.tree_sum(padded, 1))
    torch.testing.assert_close(ops.tree_sum(x, 1), x.sum(1))


def test_bad_shapes_raise_clear_errors() -> None:
    from tandem.moe_determinism import MoEDeterminismError

    with pytest.raises(MoEDeterminismError, match="inner dimensions"):
        ops.mm(torch.randn(3, 4), torch.randn(5, 6))
    with pytest.raises(MoEDeterminismError, match="multiple"):
        ops.attention(torch.randn(1, 3, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8))
    with pytest.raises(MoEDeterminismError, match="kv_split_size"):
        ops.attention(
            torch.randn(1, 2, 4, 8),
            torch.randn(1, 2, 4, 8),
            torch.randn(1, 2, 4, 8),
            kv_split_size=0,
        )
