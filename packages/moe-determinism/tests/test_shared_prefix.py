"""Scoring sequences that share a prefix as the prefix once plus each sequence's own tokens
(`forward(parents=...)`) gives the bits of scoring each whole sequence, and the same
gradients up to summation order."""

from __future__ import annotations

import pytest
import torch

from tandem.moe_determinism import (
    MoEConfig,
    MoEDeterminismError,
    MoETransformer,
    RouterReplay,
    RoutingTrace,
    batch_invariant,
)

CFG = MoEConfig(
    vocab_size=300,
    hidden_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    moe_intermediate_size=40,
    num_experts=4,
    num_experts_per_tok=2,
    kv_split_size=16,
)
PREFIX = 37  # not a multiple of the split size: the split holding it is shared and own
TAILS = [9, 1, 23]


def _model() -> MoETransformer:
    m = MoETransformer(CFG)
    m.reset_parameters(seed=3)
    return m


def _data() -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, CFG.vocab_size, (PREFIX,), generator=gen)
    tails = [torch.randint(0, CFG.vocab_size, (n,), generator=gen) for n in TAILS]
    return prefix, tails


def _whole(m: MoETransformer, prefix: torch.Tensor, tails: list[torch.Tensor], **kw):
    """Padded [B, T] batch of the whole sequences; logits of every real token, flat."""
    seqs = [torch.cat([prefix, t]) for t in tails]
    ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True)
    out = m(ids, [len(s) for s in seqs], **kw)
    return torch.cat([out.logits[i, : len(s)] for i, s in enumerate(seqs)]), out


def _shared(m: MoETransformer, prefix: torch.Tensor, tails: list[torch.Tensor], **kw):
    """Packed: the prefix once, then each tail continuing it; logits laid out like `_whole`."""
    ids = torch.cat([prefix, *tails])
    cu = torch.tensor([0, PREFIX, *(PREFIX + torch.tensor(TAILS).cumsum(0)).tolist()])
    out = m(ids, cu_seqlens=cu, parents=[-1] + [0] * len(tails), **kw)
    head, rest = out.logits[:PREFIX], out.logits[PREFIX:].split(TAILS)
    return torch.cat([torch.cat([head, r]) for r in rest]), out


def test_shared_prefix_logits_and_routes_are_bitwise_those_of_whole_sequences() -> None:
    m, (prefix, tails) = _model(), _data()
    with torch.no_grad(), batch_invariant():
        whole, w_out = _whole(m, prefix, tails)
        shared, s_out = _shared(m, prefix, tails)
    assert torch.equal(whole, shared)
    # routes: the prefix's once, then each tail's; equal to each whole sequence's
    w_routes = w_out.route_ids.split([PREFIX + n for n in TAILS])
    s_head, *s_tails = s_out.route_ids.split([PREFIX, *TAILS])
    for w, t in zip(w_routes, s_tails, strict=True):
        assert torch.equal(w, torch.cat([s_head, t]))


@pytest.mark.parametrize("invariant", [True, False])
def test_shared_prefix_gradients_match_whole_sequences(invariant: bool) -> None:
    """The prefix's keys get the gradient of every tail that attends to them: the loss over
    all tokens (prefix tokens counted once per sequence) has the same gradient both ways."""
    prefix, tails = _data()
    grads = []
    for run in (_whole, _shared):
        m = _model()
        with batch_invariant(invariant):
            logits, _ = run(m, prefix, tails)  # shared: the prefix's logits once per tail
            loss = logits.float().logsumexp(-1).sum()
            loss.backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-5, msg=name)


def test_shared_prefix_replays_recorded_routes() -> None:
    """R3 over the shared layout: the prefix's recorded experts once, each tail's after."""
    m, (prefix, tails) = _model(), _data()
    gen = torch.Generator().manual_seed(9)
    forced = [
        torch.stack(
            [torch.randperm(CFG.num_experts, generator=gen)[:2] for _ in range(n * 2)]
        ).view(n, 2, 2)
        for n in [PREFIX, *TAILS]
    ]
    traces = [RoutingTrace.from_ids(f.numpy(), CFG.num_experts) for f in forced]
    whole_traces = [
        RoutingTrace.from_ids(torch.cat([forced[0], f]).numpy(), CFG.num_experts)
        for f in forced[1:]
    ]
    with torch.no_grad(), batch_invariant():
        shared, s_out = _shared(m, prefix, tails, routing=RouterReplay(traces, "R3"))
        whole, _ = _whole(m, prefix, tails, routing=RouterReplay(whole_traces, "R3"))
    assert torch.equal(s_out.route_ids.sort(-1).values, torch.cat(forced).sort(-1).values)
    assert torch.equal(shared, whole)


def test_bad_parents_raise() -> None:
    m, (prefix, tails) = _model(), _data()
    ids = torch.cat([prefix, tails[0]])
    cu = [0, PREFIX, PREFIX + TAILS[0]]
    with pytest.raises(MoEDeterminismError, match="parents must be"):
        m(ids, cu_seqlens=cu, parents=[-1, 2])
    with pytest.raises(MoEDeterminismError, match="own parent"):
        m(ids, cu_seqlens=cu, parents=[-1, 1])
    with pytest.raises(MoEDeterminismError, match="parent has no parent"):
        m(torch.cat([ids, tails[1]]), cu_seqlens=[*cu, cu[-1] + 1], parents=[-1, 0, 1])
    cache = m.new_cache(2, 64)
    with pytest.raises(MoEDeterminismError, match="KV cache"):
        m(ids[None], cache=cache, slots=[0], parents=[-1])
