"""The CPU split attention's gradient (from torch's fused kernel, `ops.attention_grad`)
against a float64 reference, its forward bits against the graph-free call, and what its
autograd graph keeps for the backward.

Cases: grouped-query heads, queries at the end of a longer key axis (a continuation after
a shared prompt) and sequences shorter than the key axis whose later queries may not see
the padding keys, with 1 and 2 threads.
"""

from __future__ import annotations

import pytest
import torch

from tandem.moe_determinism import ops

CASES = {
    # name: (batch, query heads, kv heads, queries, keys, head dim, kv lengths or None)
    "mha": (2, 2, 2, 40, 40, 16, None),
    "gqa": (2, 6, 2, 70, 70, 24, None),
    "continuation": (3, 4, 2, 20, 90, 16, None),
    "padded keys": (3, 4, 1, 33, 33, 8, [33, 17, 5]),
}


def _inputs(case: str, dtype: torch.dtype = torch.float32):
    b, hq, hkv, tq, tk, d, lengths = CASES[case]
    g = torch.Generator().manual_seed(len(case))
    q = torch.randn(b, hq, tq, d, generator=g, dtype=dtype)
    k = torch.randn(b, hkv, tk, d, generator=g, dtype=dtype)
    v = torch.randn(b, hkv, tk, d, generator=g, dtype=dtype)
    kv = torch.tensor(lengths) if lengths else torch.full((b,), tk)
    if lengths:  # queries at positions 0.. of every row: the length limit hides later keys
        pos = torch.arange(tq)[None, :].expand(b, tq)
    else:  # the last queries see the last keys
        pos = kv[:, None] - tq + torch.arange(tq)[None, :]
    return q, k, v, pos, kv


def _reference(q, k, v, pos, kv, scale):
    """Masked softmax attention in float64, each query head reading its KV head."""
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    keys = torch.arange(k.shape[2])
    visible = (keys[None, None, :] < kv[:, None, None]) & (keys[None, None, :] <= pos[:, :, None])
    scores = (q @ kk.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    return torch.softmax(scores, -1) @ vv


@pytest.mark.parametrize("case", sorted(CASES))
def test_gradient_matches_float64(case: str, threads: int) -> None:
    q, k, v, pos, kv = _inputs(case)
    scale = q.shape[-1] ** -0.5
    seed = torch.randn(
        q.shape[0], q.shape[1], q.shape[2], v.shape[-1], generator=torch.Generator().manual_seed(1)
    )
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ops.attention(*leaves, kv_split_size=16, q_positions=pos, kv_lengths=kv, scale=scale)
    grads = torch.autograd.grad((out * seed).sum(), leaves)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = _reference(*ref_leaves, pos, kv, scale)
    ref_grads = torch.autograd.grad((ref * seed.double()).sum(), ref_leaves)
    torch.testing.assert_close(out.double(), ref.detach(), rtol=0, atol=2e-5)
    for name, got, want in zip("qkv", grads, ref_grads, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=5e-5, msg=f"d{name}")


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_bits_are_those_of_the_graph_free_call(case: str, threads: int) -> None:
    q, k, v, pos, kv = _inputs(case)
    with torch.no_grad():
        plain = ops.attention(q, k, v, kv_split_size=16, q_positions=pos, kv_lengths=kv)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ops.attention(*leaves, kv_split_size=16, q_positions=pos, kv_lengths=kv)
    assert out.requires_grad and torch.equal(out.detach(), plain)


def test_the_graph_keeps_only_the_inputs_and_the_output() -> None:
    """Saved for backward: q, k, v, the positions, the output and its log-sum-exp, nothing
    that grows with queries x keys (the split attention's own graph kept every block's
    scores and probabilities)."""
    q, k, v, pos, kv = _inputs("gqa")
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = ops.attention(*leaves, kv_split_size=16, q_positions=pos, kv_lengths=kv)
    lse = q.shape[0] * q.shape[1] * q.shape[2] * 4  # fp32, one per query row
    inputs = sum(t.numel() * t.element_size() for t in (q, k, v, pos, kv, out)) + lse
    assert 0 < sum(saved) <= inputs, (saved, inputs)
    out.sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in leaves)


def test_bf16_gradient_is_close() -> None:
    q, k, v, pos, kv = _inputs("gqa", torch.bfloat16)
    scale = q.shape[-1] ** -0.5
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ops.attention(*leaves, kv_split_size=16, q_positions=pos, kv_lengths=kv, scale=scale)
    grads = torch.autograd.grad(out.float().sum(), leaves)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref_grads = torch.autograd.grad(_reference(*ref_leaves, pos, kv, scale).sum(), ref_leaves)
    for got, want in zip(grads, ref_grads, strict=True):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), want, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("case", ["continuation", "padded keys"])
def test_masked_gradient_in_query_ranges_matches_float64(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows that need an explicit mask take their gradient a range of queries at a time
    (`MASK_ELEMENTS` mask entries per fused call); the key and value gradients add up over
    the ranges to the float64 reference's."""
    from tandem.moe_determinism.ops import attention_grad

    q, k, v, pos, kv = _inputs(case)
    budget = 7 * k.shape[2]  # 7 queries of the longest row a call
    monkeypatch.setattr(attention_grad, "MASK_ELEMENTS", budget)
    masked: list[int] = []  # mask entries of each call that needs a mask
    fused = attention_grad._fused

    def counted(grad, q_part, k_part, v_part, mask, *rest):
        if mask is not None:
            masked.append(mask.numel())
        return fused(grad, q_part, k_part, v_part, mask, *rest)

    monkeypatch.setattr(attention_grad, "_fused", counted)
    scale = q.shape[-1] ** -0.5
    seed = torch.randn(
        q.shape[0], q.shape[1], q.shape[2], v.shape[-1], generator=torch.Generator().manual_seed(2)
    )
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ops.attention(*leaves, kv_split_size=16, q_positions=pos, kv_lengths=kv, scale=scale)
    grads = torch.autograd.grad((out * seed).sum(), leaves)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref_grads = torch.autograd.grad(
        (_reference(*ref_leaves, pos, kv, scale) * seed.double()).sum(), ref_leaves
    )
    assert len(masked) > q.shape[0] and max(masked) <= budget, masked
    for name, got, want in zip("qkv", grads, ref_grads, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=5e-5, msg=f"d{name}")


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_forwards_log_sum_exp_is_that_of_the_scores(case: str, threads: int) -> None:
    """What the backward is given instead of running a second forward: each query's
    log-sum-exp of its visible scaled scores, against float64 `torch.logsumexp`."""
    from tandem.moe_determinism.ops import split_attention

    q, k, v, pos, kv = _inputs(case)
    scale = q.shape[-1] ** -0.5
    out, lse = split_attention._attention_cpu(q, k, v, True, 16, pos, kv, scale, with_lse=True)
    assert torch.equal(out, split_attention._attention_cpu(q, k, v, True, 16, pos, kv, scale))
    group = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(group, 1)
    keys = torch.arange(k.shape[2])
    visible = (keys[None, None, :] < kv[:, None, None]) & (keys[None, None, :] <= pos[:, :, None])
    scores = (q.double() @ kk.transpose(-1, -2)) * scale
    want = torch.logsumexp(scores.masked_fill(~visible[:, None], float("-inf")), -1)
    assert lse.shape == want.shape and lse.dtype == torch.float32
    torch.testing.assert_close(lse.double(), want, rtol=0, atol=1e-5)
