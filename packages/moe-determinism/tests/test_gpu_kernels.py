"""The compiled Triton kernels on a GPU: the same row gives the same bits whatever batch it
sits in, at whatever position, on whatever CUDA stream, in fp32 and bf16; and the model
decoding a staggered batch with its KV cache gives the bits of scoring each sequence alone.
"""

from __future__ import annotations

import pytest
import torch

from tandem.moe_determinism import (
    MoEConfig,
    MoETransformer,
    RoutingTrace,
    batch_invariant,
    ops,
    target_logprobs,
)

pytestmark = pytest.mark.gpu
DTYPES = [torch.float32, torch.bfloat16]
DEV = "cuda"

# The demo's policy (configs/demo.toml [model]; kv_split_size at its default).
DEMO = MoEConfig(
    vocab_size=266,
    hidden_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    moe_intermediate_size=144,
    num_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=4096,
)


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(*shape, device=DEV, generator=gen).to(dtype)


def _row_ops(dtype: torch.dtype):
    w = _randn(384, 512, dtype=dtype, seed=1)
    return {
        "linear": (_randn(64, 512, dtype=dtype, seed=2), lambda t: ops.linear(t, w)),
        "log_softmax": (_randn(64, 32000, dtype=dtype, seed=3), lambda t: ops.log_softmax(t, -1)),
        "rms_norm": (_randn(64, 4096, dtype=dtype, seed=4), lambda t: ops.rms_norm(t, None)),
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_equal_at_any_position_of_any_batch(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    for name, (x, fn) in _row_ops(dtype).items():
        full = fn(x)
        for m in (1, 2, 3, 7, 16, 33, 63):
            pick = torch.randperm(64, generator=gen)[:m].to(DEV)  # other rows, other places
            assert torch.equal(fn(x[pick]), full[pick]), f"{name} m={m}"
            assert torch.equal(fn(x[pick[-1:]])[0], full[pick[-1]]), f"{name} alone"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_equal_on_other_cuda_streams(dtype: torch.dtype) -> None:
    for name, (x, fn) in _row_ops(dtype).items():
        ref = fn(x)
        streams = [torch.cuda.Stream() for _ in range(2)]
        outs = []
        for i, s in enumerate(streams):  # both queued before either is waited on
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                outs.append(fn(x[: 64 - 16 * i]))
        torch.cuda.synchronize()
        for i, out in enumerate(outs):
            assert torch.equal(out, ref[: 64 - 16 * i]), f"{name} on stream {i}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_attention_equals_prefill_at_every_split_boundary(dtype: torch.dtype) -> None:
    q = _randn(3, 8, 300, 64, dtype=dtype, seed=5)
    k, v = _randn(3, 2, 300, 64, dtype=dtype, seed=6), _randn(3, 2, 300, 64, dtype=dtype, seed=7)
    full = ops.attention(q, k, v, kv_split_size=64)
    for pos in (0, 1, 63, 64, 65, 127, 128, 200, 299):
        for rows in (slice(0, 3), slice(1, 2)):  # the whole batch, one sequence alone
            dec = ops.attention(
                q[rows, :, pos : pos + 1], k[rows, :, : pos + 1], v[rows, :, : pos + 1],
                kv_split_size=64,
            )  # fmt: skip
            assert torch.equal(dec[:, :, 0], full[rows, :, pos]), f"pos {pos}"


def _demo_model(dtype: torch.dtype) -> MoETransformer:
    m = MoETransformer(DEMO)
    m.reset_parameters(seed=0)
    return m.to(device=DEV, dtype=dtype).eval()


def _staggered(m: MoETransformer, seqs: list[torch.Tensor]):
    """Sequences join one step apart and decode one token per step in one batch."""
    cache = m.new_cache(max_slots=len(seqs), max_len=max(len(s) for s in seqs) + 1)
    logits: list[list[torch.Tensor]] = [[] for _ in seqs]
    traces: list[list[RoutingTrace]] = [[] for _ in seqs]
    pos = [0] * len(seqs)
    step = 0
    while any(p < len(s) for p, s in zip(pos, seqs, strict=True)):
        active = [i for i in range(len(seqs)) if i <= step and pos[i] < len(seqs[i])]
        n = [8 if pos[i] == 0 else 1 for i in active]  # a prompt chunk, then one token
        ids = torch.zeros(len(active), max(n), dtype=torch.long, device=DEV)
        for j, i in enumerate(active):
            ids[j, : n[j]] = seqs[i][pos[i] : pos[i] + n[j]]
        out = m(ids, lengths=n, cache=cache, slots=active)
        for j, (i, tr) in enumerate(zip(active, out.traces(), strict=True)):
            logits[i].append(out.logits[j, : n[j]])
            traces[i].append(tr)
            pos[i] += n[j]
        step += 1
    return [torch.cat(x) for x in logits], [RoutingTrace.concat(t) for t in traces]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_demo_model_decoding_equals_scoring_bit_for_bit(dtype: torch.dtype) -> None:
    m = _demo_model(dtype)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, DEMO.vocab_size, (n,), generator=gen).to(DEV) for n in (40, 23, 31)]
    with torch.no_grad(), batch_invariant():
        decoded, traces = _staggered(m, seqs)
        for i, s in enumerate(seqs):
            alone = m(s[None])
            ref = target_logprobs(alone.logits[0, :-1], s[1:])
            got = target_logprobs(decoded[i][:-1], s[1:])
            assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), f"seq {i}"
            assert traces[i] == alone.traces()[0], f"routes of seq {i}"
