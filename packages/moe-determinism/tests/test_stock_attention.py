"""Attention outside `batch_invariant()` without a KV cache (whole sequences in one fused
call, a shared-prefix layout one sequence at a time: `model/attention.py`), against
attention written out in float64."""

from __future__ import annotations

import pytest
import torch

from tandem.moe_determinism.model.attention import attend
from tandem.moe_determinism.model.basics import TokenLayout

H, HKV, D = 4, 2, 8


def _layout(counts: list[int], parents: list[int] | None) -> TokenLayout:
    """Sequences of ``counts`` new tokens; with ``parents``, a child continues its parent
    (offset: the parent's length), as the trainer's shared-prefix layout does."""
    offsets = [0] * len(counts)
    if parents is not None:
        offsets = [0 if p < 0 else counts[p] for p in parents]
    seq_of = torch.cat([torch.full((n,), i) for i, n in enumerate(counts)])
    index = torch.cat([torch.arange(n) for n in counts])
    off = torch.tensor(offsets)
    return TokenLayout(
        seq_of=seq_of,
        index=index,
        counts=torch.tensor(counts),
        offsets=off,
        positions=off[seq_of] + index,
        parents=None if parents is None else torch.tensor(parents),
    )


def _reference(q, k, v, layout: TokenLayout) -> torch.Tensor:
    """Each token's attention over the keys its sequence sees (its parent's, then its own up
    to itself), in float64, one token at a time."""
    q, k, v = q.double(), k.double(), v.double()
    starts = torch.cat([torch.zeros(1, dtype=torch.long), layout.counts.cumsum(0)])
    out = torch.empty_like(q)
    for t in range(q.shape[0]):
        s, i = int(layout.seq_of[t]), int(layout.index[t])
        own = torch.arange(int(starts[s]), int(starts[s]) + i + 1)
        if layout.parents is not None and int(layout.parents[s]) >= 0:
            p = int(layout.parents[s])
            own = torch.cat(
                [torch.arange(int(starts[p]), int(starts[p]) + int(layout.offsets[s])), own]
            )
        keys = k[own].repeat_interleave(H // HKV, 1)  # [n, H, D]
        vals = v[own].repeat_interleave(H // HKV, 1)
        w = torch.softmax((keys * q[t][None]).sum(-1) / D**0.5, dim=0)  # [n, H]
        out[t] = (w[..., None] * vals).sum(0)
    return out


@pytest.mark.parametrize(
    ("counts", "parents"),
    [([13, 5, 9, 1], [-1, 0, 0, 0]), ([7, 12, 3], None), ([20, 4, 6, 2], [-1, 0, -1, 2])],
)
def test_stock_attention_by_sequence_matches_float64(counts, parents) -> None:
    layout = _layout(counts, parents)
    n = int(layout.counts.sum())
    gen = torch.Generator().manual_seed(len(counts))
    q, k, v = (torch.randn(n, h, D, generator=gen) for h in (H, HKV, HKV))
    for t in (q, k, v):
        t.requires_grad_()
    out = attend(q, k, v, layout, layer_idx=0, kv_split_size=16)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = _reference(*ref_in, layout)
    torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    weights = torch.randn(out.shape, generator=gen)
    (out * weights).sum().backward()
    (ref * weights.double()).sum().backward()
    for got, want in zip((q, k, v), ref_in, strict=True):
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-4, atol=1e-5)


def test_stock_attention_tail_takes_the_fused_kernel() -> None:
    """A tail's queries see its parent's keys through a [count, keys] mask: the same bits as
    torch's fused attention called on that tail alone (a 3-D mask would send it down the
    unfused path: other bits, and about 1.5x the time)."""
    counts, parents = [300, 120], [-1, 0]
    layout = _layout(counts, parents)
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(sum(counts), h, D, generator=gen) for h in (H, HKV, HKV))
    out = attend(q, k, v, layout, layer_idx=0, kv_split_size=16)
    tail = slice(counts[0], sum(counts))
    keys = torch.cat([k[: counts[0]], k[tail]]).transpose(0, 1)[None]  # [1, HKV, 420, D]
    values = torch.cat([v[: counts[0]], v[tail]]).transpose(0, 1)[None]
    keys, values = keys.repeat_interleave(H // HKV, 1), values.repeat_interleave(H // HKV, 1)
    visible = torch.arange(sum(counts))[None, :] <= torch.arange(counts[0], sum(counts))[:, None]
    want = torch.nn.functional.scaled_dot_product_attention(
        q[tail].transpose(0, 1)[None], keys, values, attn_mask=visible, scale=D**-0.5
    )
    assert torch.equal(out[tail], want[0].transpose(0, 1))
