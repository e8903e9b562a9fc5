"""The closed-form attention backward against autograd through plain masked attention."""

from __future__ import annotations

import torch

from tandem.moe_determinism.ops.split_attention import attention_mask
from tandem.orchestrator.attention_grad import attention_backward


def _reference(q, k, v, positions, lengths):
    group = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ kr.transpose(-1, -2) * q.shape[-1] ** -0.5
    visible = attention_mask(positions, lengths, k.shape[2], True)[:, None]
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
    return probs @ vr


def test_backward_matches_autograd() -> None:
    gen = torch.Generator().manual_seed(0)
    b, hq, hkv, t, d = 2, 4, 2, 9, 8
    q, k, v = (torch.randn(b, h, t, d, generator=gen, dtype=torch.float64) for h in (hq, hkv, hkv))
    positions = torch.arange(t).expand(b, t)
    lengths = torch.tensor([t, 6])
    grad_out = torch.randn(b, hq, t, d, generator=gen, dtype=torch.float64)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    _reference(*leaves, positions, lengths).backward(grad_out)
    got = attention_backward(q, k, v, grad_out, positions, lengths, True, None)
    for ref, mine in zip(leaves, got, strict=True):
        torch.testing.assert_close(mine, ref.grad, rtol=1e-5, atol=1e-6)
