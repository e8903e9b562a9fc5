"""Must-hold 3 and 4: the reference model is batch-invariant end to end; router replay."""

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
    routing_agreement,
    target_logprobs,
)

CFG = MoEConfig(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    moe_intermediate_size=64,
    num_experts=8,
    num_experts_per_tok=2,
    kv_split_size=16,
    shared_expert_intermediate_size=32,
)
LENS = [37, 5, 20]


def _model(seed: int = 0) -> MoETransformer:
    m = MoETransformer(CFG)
    m.reset_parameters(seed=seed)
    return m.eval()


def _seqs() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, CFG.vocab_size, (n,), generator=gen) for n in LENS]


def _staggered_decode(
    m: MoETransformer, seqs: list[torch.Tensor], max_len: int = 64
) -> tuple[list[torch.Tensor], list[RoutingTrace]]:
    """Sequences join at different times (prefill of a first turn), then decode token by token
    in one batch; sequence 2 gets its second turn appended as a 6-token chunk."""
    cache = m.new_cache(max_slots=4, max_len=max_len)
    logits: list[list[torch.Tensor]] = [[] for _ in seqs]
    traces: list[list[RoutingTrace]] = [[] for _ in seqs]
    pos = [0] * len(seqs)
    slot = {0: 3, 1: 0, 2: 1}  # slots need not match sequence order

    def step(active: list[int], n_tokens: list[int]) -> None:
        t = max(n_tokens)
        ids = torch.zeros(len(active), t, dtype=torch.long)
        for j, i in enumerate(active):
            ids[j, : n_tokens[j]] = seqs[i][pos[i] : pos[i] + n_tokens[j]]
        out = m(ids, lengths=n_tokens, cache=cache, slots=[slot[i] for i in active])
        for j, (i, tr) in enumerate(zip(active, out.traces(), strict=True)):
            logits[i].append(out.logits[j, : n_tokens[j]])
            traces[i].append(tr)
            pos[i] += n_tokens[j]

    step([0], [10])
    step([0, 1], [1, 2])
    step([2, 0], [4, 1])
    while any(p < len(s) for p, s in zip(pos, seqs, strict=True)):
        active = [i for i in range(len(seqs)) if pos[i] < len(seqs[i])]
        n = [6 if (i == 2 and pos[i] == 8) else 1 for i in active]
        step(active, n)
    return [torch.cat(x) for x in logits], [RoutingTrace.concat(t) for t in traces]


def test_model_logprobs_bitwise_identical_across_batchings(threads: int) -> None:
    m, seqs = _model(), _seqs()
    with torch.no_grad(), batch_invariant():
        alone = [m(s[None]) for s in seqs]
        padded_ids = torch.zeros(len(seqs), max(LENS), dtype=torch.long)
        for i, s in enumerate(seqs):
            padded_ids[i, : len(s)] = s
        padded = m(padded_ids, lengths=LENS)
        packed = m(torch.cat(seqs), cu_seqlens=[0, 37, 42, 62])
        decoded, dec_traces = _staggered_decode(m, seqs)
    start = 0
    for i, s in enumerate(seqs):
        ref = target_logprobs(alone[i].logits[0, :-1], s[1:])
        ref_trace = alone[i].traces()[0]
        variants = {
            "padded": padded.logits[i, : len(s)],
            "packed": packed.logits[start : start + len(s)],
            "decoded": decoded[i],
        }
        for name, logits in variants.items():
            assert torch.equal(target_logprobs(logits[:-1], s[1:]), ref), f"{name} seq {i}"
        assert torch.equal(alone[i].logits[0], decoded[i])
        assert packed.traces()[i] == ref_trace
        assert padded.traces()[i] == ref_trace
        assert dec_traces[i] == ref_trace
        assert routing_agreement(dec_traces[i], ref_trace).per_token == 1.0
        start += len(s)


def test_stock_ops_show_the_mismatch_the_scope_removes() -> None:
    """Control: without the scope the same comparison is not bitwise (MKL changes kernels
    with the batch size), so the test above measures something real."""
    m, seqs = _model(), _seqs()
    with torch.no_grad():
        alone = m(seqs[0][None]).logits[0]
        decoded, _ = _staggered_decode(m, seqs)
    assert not torch.equal(alone, decoded[0])
    torch.testing.assert_close(alone, decoded[0], rtol=1e-4, atol=1e-4)


def _perturb_router(m: MoETransformer, scale: float) -> None:
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in m.layers:
            w = layer.mlp.gate.weight
            w.add_(torch.randn(w.shape, generator=gen) * scale)


@pytest.mark.parametrize("mode", ["R2", "R3"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_router_replay_forces_recorded_experts(mode: str, checkpointing: bool) -> None:
    m, seqs = _model(), _seqs()
    with torch.no_grad(), batch_invariant():
        if mode == "R3":  # routes from the inference engine: token-by-token decoding
            _, traces = _staggered_decode(m, seqs)
        else:  # routes from the trainer's own old-policy pass
            traces = m(torch.cat(seqs), cu_seqlens=[0, 37, 42, 62]).traces()
    # Move the policy: an optimizer step on the router plus noise large enough to flip routes.
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    m.train()
    m.activation_checkpointing = checkpointing
    out = m(torch.cat(seqs), cu_seqlens=[0, 37, 42, 62])
    out.logits.square().mean().backward()
    opt.step()
    opt.zero_grad()
    _perturb_router(m, 0.5)

    free = m(torch.cat(seqs), cu_seqlens=[0, 37, 42, 62])
    assert (
        routing_agreement(
            RoutingTrace.concat(free.traces()), RoutingTrace.concat(traces)
        ).per_decision
        < 0.95
    )

    replayed = m(
        torch.cat(seqs), cu_seqlens=[0, 37, 42, 62], routing=RouterReplay(traces, mode=mode)
    )
    assert replayed.traces() == traces  # exactly the recorded experts
    targets = torch.cat([torch.cat([s[1:], s[:1]]) for s in seqs])
    target_logprobs(replayed.logits, targets).sum().backward()
    for layer in m.layers:
        g = layer.mlp.gate.weight.grad
        assert g is not None and bool(g.abs().sum() > 0), "router got no gradient under replay"


def test_replay_with_checkpointing_matches_without() -> None:
    m, seqs = _model(), _seqs()
    traces = m(torch.cat(seqs), cu_seqlens=[0, 37, 42, 62]).traces()
    grads = []
    for ckpt in (False, True):
        m.zero_grad()
        m.activation_checkpointing = ckpt
        out = m(torch.cat(seqs), cu_seqlens=[0, 37, 42, 62], routing=RouterReplay(traces, "R2"))
        out.logits.float().logsumexp(-1).sum().backward()
        grads.append([p.grad.clone() for p in m.parameters() if p.grad is not None])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_replay_misuse_raises() -> None:
    m, seqs = _model(), _seqs()
    with torch.no_grad():
        traces = m(torch.cat(seqs), cu_seqlens=[0, 37, 42, 62]).traces()
        replay = RouterReplay(traces, "R3")
        m(torch.cat(seqs), cu_seqlens=[0, 37, 42, 62], routing=replay)
        with pytest.raises(MoEDeterminismError, match="consumed exactly once"):
            m(torch.cat(seqs), cu_seqlens=[0, 37, 42, 62], routing=replay)
        with pytest.raises(MoEDeterminismError, match="tokens"):
            m(torch.cat(seqs), cu_seqlens=[0, 37, 42, 62], routing=RouterReplay(traces[::-1], "R3"))
        with pytest.raises(MoEDeterminismError, match="sequences"):
            m(torch.cat(seqs), cu_seqlens=[0, 37, 42, 62], routing=RouterReplay(traces[:2], "R3"))
        with pytest.raises(MoEDeterminismError, match="R2"):
            RouterReplay(traces, "R4")  # type: ignore[arg-type]
        fresh = RouterReplay(traces, "R3")
        fresh.bind([37, 5, 20], CFG.num_hidden_layers, CFG.num_experts_per_tok, CFG.num_experts)
        fresh.take(0)
        with pytest.raises(MoEDeterminismError, match="already consumed"):
            fresh.take(0)
        with pytest.raises(MoEDeterminismError, match="never replayed"):
            fresh.finish()


@pytest.mark.parametrize("max_len", [37, 50, 63])
def test_a_cache_of_any_length_is_read_in_place(max_len: int, monkeypatch) -> None:
    """A cache whose length is not a whole number of KV splits is stored in whole splits, so
    the invariant attention reads every step's keys from it in place (it copied every row's
    keys out first, each step, before), with the bits of a cache of whole splits."""
    from tandem.moe_determinism.ops import split_attention

    passes = []
    real = split_attention._attention_cpu_pass

    def spy(*args, **kw):
        passes.append(args[8] if len(args) > 8 else kw.get("kv_slots"))
        return real(*args, **kw)

    m, seqs = _model(), _seqs()
    assert m.new_cache(2, max_len).keys[0].shape[2] % CFG.kv_split_size == 0
    with batch_invariant():
        whole, whole_traces = _staggered_decode(m, seqs, max_len=64)
        monkeypatch.setattr(split_attention, "_attention_cpu_pass", spy)
        got, traces = _staggered_decode(m, seqs, max_len=max_len)
    assert passes and all(slots is not None for slots in passes)
    for a, b in zip(got, whole, strict=True):
        assert torch.equal(a, b)
    assert traces == whole_traces


def test_bad_inputs_raise() -> None:
    m = _model()
    with torch.no_grad():
        with pytest.raises(MoEDeterminismError, match="vocab"):
            m(torch.tensor([[1, 2, 9999]]))
        with pytest.raises(MoEDeterminismError, match="cu_seqlens"):
            m(torch.tensor([1, 2, 3]), cu_seqlens=[0, 2])
        cache = m.new_cache(1, 4)
        with pytest.raises(MoEDeterminismError, match="KV cache full"):
            m(torch.tensor([[1, 2, 3, 4, 5]]), cache=cache, slots=[0])
        with pytest.raises(MoEDeterminismError, match="slots"):
            m(torch.tensor([[1, 2]]), cache=cache)
