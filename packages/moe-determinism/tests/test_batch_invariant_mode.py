"""`batch_invariant()` routes torch's own ops and restores them on exit."""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from tandem.moe_determinism import batch_invariant, is_batch_invariant, ops, stock_kernels


def _variant_rows(fn, x: torch.Tensor) -> list[int]:
    full = fn(x)
    return [m for m in range(1, x.shape[0] + 1) if not torch.equal(fn(x[:m]), full[:m])]


def test_scope_routes_torch_ops_to_invariant_ones(threads: int) -> None:
    a, w, b = torch.randn(64, 300), torch.randn(200, 300), torch.randn(200)
    x = torch.randn(64, 40000)
    with batch_invariant():
        assert is_batch_invariant()
        assert _variant_rows(lambda t: F.linear(t, w, b), a) == []
        assert _variant_rows(lambda t: t @ w.t(), a) == []
        assert _variant_rows(lambda t: torch.log_softmax(t, -1), x) == []
        assert _variant_rows(lambda t: torch.softmax(t, -1), x) == []
        assert _variant_rows(lambda t: t.mean(-1), x) == []
        assert _variant_rows(lambda t: F.rms_norm(t, (t.shape[-1],)), x) == []
        assert _variant_rows(F.silu, x[:, :1000]) == []
        assert _variant_rows(torch.sigmoid, x[:, :1000]) == []
        # torch's op now computes exactly what the invariant op computes.
        assert torch.equal(F.linear(a, w), ops.linear(a, w))
        assert torch.equal(torch.log_softmax(x, -1), ops.log_softmax(x, -1))
    assert not is_batch_invariant()


def test_scope_restores_stock_kernels_and_nests() -> None:
    a, w = torch.randn(5, 300), torch.randn(200, 300)
    x = torch.randn(4, 1000)
    stock_lin, stock_silu = F.linear(a, w), F.silu(x)
    with batch_invariant():
        with batch_invariant():  # re-entry keeps the overrides ...
            assert torch.equal(F.linear(a, w), ops.linear(a, w))
        assert is_batch_invariant()  # ... and leaving the inner scope does not drop them
        assert torch.equal(F.linear(a, w), ops.linear(a, w))
    assert torch.equal(F.linear(a, w), stock_lin)
    assert torch.equal(F.silu(x), stock_silu)
    with batch_invariant():  # and a fresh scope registers again
        assert torch.equal(F.silu(x), ops.silu(x))


def test_disabled_scope_is_a_no_op() -> None:
    with batch_invariant(enabled=False):
        assert not is_batch_invariant()


def test_autograd_flows_through_overrides() -> None:
    w = torch.randn(20, 30, requires_grad=True)
    x = torch.randn(7, 30, requires_grad=True)
    with batch_invariant():
        y = torch.log_softmax(F.silu(F.linear(x, w)), -1).mean()
        y.backward()
    w_ref, x_ref = w.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    torch.log_softmax(F.silu(F.linear(x_ref, w_ref)), -1).mean().backward()
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)


def test_scope_from_two_threads() -> None:
    a, w = torch.randn(9, 64), torch.randn(32, 64)
    expected = ops.linear(a, w)
    errors: list[str] = []

    def work() -> None:
        for _ in range(20):
            with batch_invariant():
                if not torch.equal(F.linear(a, w), expected):
                    errors.append("mismatch")

    ts = [threading.Thread(target=work) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert errors == []
    assert not is_batch_invariant()


def test_stock_kernels_on_one_thread_inside_the_scope(monkeypatch) -> None:
    """Inside `stock_kernels()` the calling thread computes torch's own bits and never enters
    an invariant kernel (the scope stays registered); outside it, the invariant ones again."""
    from tandem.moe_determinism.ops import gemm, reduction

    calls: list[str] = []
    for module, name in [(gemm, "mm_blocks"), (gemm, "bmm_blocks")] + [
        (reduction, n) for n in ("softmax", "log_softmax", "mean", "silu", "sigmoid")
    ]:
        real = getattr(module, name)
        monkeypatch.setattr(
            module,
            name,
            lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k),
        )
    a, w, bias = torch.randn(5, 300), torch.randn(200, 300), torch.randn(200)
    x = torch.randn(7, 1000) * 3

    def run() -> dict[str, torch.Tensor]:
        return {
            "linear": F.linear(a, w),
            "linear with bias": F.linear(a, w, bias),  # addmm: torch's fused kernel
            "log_softmax": torch.log_softmax(x, -1),
            "softmax": torch.softmax(x, -1),
            "mean": x.mean(-1),
            "silu": F.silu(x),
            "sigmoid": torch.sigmoid(x),
            "bmm": torch.bmm(x[None, :, :300], w.t()[None]),
        }

    stock = run()
    with batch_invariant():
        with stock_kernels():
            assert not is_batch_invariant()
            now = run()
        assert calls == []
        assert is_batch_invariant()
        run()
    assert sorted(set(calls)) == sorted(
        ["mm_blocks", "bmm_blocks", "softmax", "log_softmax", "mean", "silu", "sigmoid"]
    )
    for name, value in stock.items():
        assert torch.equal(now[name], value), name


def test_stock_kernels_leave_other_threads_invariant() -> None:
    a, w = torch.randn(9, 64), torch.randn(32, 64)
    expected, stock = ops.linear(a, w), F.linear(a, w)
    seen: dict[str, bool] = {}
    inside, done = threading.Event(), threading.Event()

    def other() -> None:
        inside.wait()
        seen["other_invariant"] = is_batch_invariant()
        seen["other_bits"] = torch.equal(F.linear(a, w), expected)
        done.set()

    t = threading.Thread(target=other)
    with batch_invariant():
        t.start()
        with stock_kernels():
            inside.set()
            done.wait()
            seen["own_bits"] = torch.equal(F.linear(a, w), stock)
    t.join()
    assert seen == {"other_invariant": True, "other_bits": True, "own_bits": True}
