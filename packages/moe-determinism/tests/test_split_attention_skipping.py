"""The CPU split attention skips fully masked (query block, KV split) pairs without changing
a bit: checked against the dense all-pairs computation kept here as the slow reference."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from tandem.moe_determinism import batch_invariant, ops
from tandem.moe_determinism.ops import split_attention
from tandem.moe_determinism.ops.gemm import fixed_shape_bmm
from tandem.moe_determinism.ops.reduction import fixed_sum

Q_BLOCK = split_attention.Q_BLOCK


def _padded_tree_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Adjacent-pair tree over `dim` after materialising the zero padding to a power of two."""
    n = x.shape[dim]
    size = 1 << (n - 1).bit_length()
    if size != n:
        shape = list(x.shape)
        shape[dim] = size - n
        x = torch.cat([x, x.new_zeros(shape)], dim=dim)
    while x.shape[dim] > 1:
        x = x.unflatten(dim, (-1, 2))
        x = x.select(dim + 1, 0) + x.select(dim + 1, 1)
    return x.squeeze(dim)


def _all_pairs_reference(q, k, v, causal, split, q_positions, kv_lengths, scale):
    """Every (query block, KV split) pair computed, then masked: the dense formulation."""
    b, hq, tq, d = q.shape
    hkv, tk, dv = k.shape[1], k.shape[2], v.shape[3]
    group = hq // hkv
    acc_dtype = torch.float32 if q.dtype in (torch.bfloat16, torch.float16) else q.dtype
    rows = group * tq
    n_rb = max(1, -(-rows // Q_BLOCK))
    n_sp = max(1, -(-tk // split))
    rows_p, keys_p = n_rb * Q_BLOCK, n_sp * split
    qr = q.reshape(b, hkv, rows, d)
    qr = F.pad(qr, (0, 0, 0, rows_p - rows)).view(b, hkv, n_rb, 1, Q_BLOCK, d)
    kp = F.pad(k, (0, 0, 0, keys_p - tk)).view(b, hkv, 1, n_sp, split, d)
    vp = F.pad(v, (0, 0, 0, keys_p - tk)).view(b, hkv, 1, n_sp, split, dv)
    blocks = b * hkv * n_rb * n_sp
    q_blk = qr.expand(b, hkv, n_rb, n_sp, Q_BLOCK, d).reshape(blocks, Q_BLOCK, d)
    k_blk = kp.expand(b, hkv, n_rb, n_sp, split, d).reshape(blocks, split, d)
    scores = fixed_shape_bmm(q_blk, k_blk.transpose(1, 2))
    scores = scores.to(acc_dtype).view(b, hkv, n_rb, n_sp, Q_BLOCK, split) * scale
    query_of_row = torch.arange(rows_p) % tq
    pos = q_positions[:, query_of_row]
    visible = ops.attention_mask(pos, kv_lengths, keys_p, causal).expand(b, rows_p, keys_p).clone()
    visible[:, rows:, 0] = True
    visible = visible.view(b, 1, n_rb, Q_BLOCK, n_sp, split).permute(0, 1, 2, 4, 3, 5)
    scores = scores.masked_fill(~visible, float("-inf"))
    m = scores.amax(dim=(3, 5), keepdim=True)
    p = torch.exp(scores - m)
    denom = _padded_tree_sum(fixed_sum(p, -1), dim=3)
    v_blk = vp.expand(b, hkv, n_rb, n_sp, split, dv).reshape(blocks, split, dv)
    partial = fixed_shape_bmm(p.to(q.dtype).reshape(blocks, Q_BLOCK, split), v_blk)
    partial = partial.to(acc_dtype).view(b, hkv, n_rb, n_sp, Q_BLOCK, dv)
    out = _padded_tree_sum(partial, dim=3) / denom[..., None]
    out = out.reshape(b, hkv, rows_p, dv)[:, :, :rows]
    return out.reshape(b, hq, tq, dv).to(q.dtype)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """Integer view, so that -0.0 vs +0.0 and NaN payloads would count as differences."""
    return x.view(torch.int32 if x.dtype == torch.float32 else torch.int16)


def _random_case(rng: random.Random, dtype: torch.dtype, seed: int):
    b, hkv, group = rng.randint(1, 3), rng.randint(1, 2), rng.choice([1, 2, 3])
    d, tk = rng.choice([8, 24]), rng.randint(1, 140)
    tq = rng.choice([1, rng.randint(1, tk)])
    split, causal = rng.choice([16, 32, 64]), rng.random() < 0.75
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hkv * group, tq, d, generator=gen).to(dtype)
    k = torch.randn(b, hkv, tk, d, generator=gen).to(dtype)
    v = torch.randn(b, hkv, tk, d, generator=gen).to(dtype)
    # Padded batch: every row holds tq..tk valid keys; queries either the last tq of them
    # (prefill / chunked prefill / decode) or random sorted positions (a packed layout).
    kv_lengths = torch.tensor([rng.randint(tq, tk) for _ in range(b)])
    if rng.random() < 0.5:
        q_positions = kv_lengths[:, None] - tq + torch.arange(tq)[None, :]
    else:
        q_positions = torch.stack(
            [torch.randint(0, int(n), (tq,), generator=gen).sort().values for n in kv_lengths]
        )
    return (q, k, v, causal, split, q_positions, kv_lengths, d**-0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_skipping_is_bitwise_identical_to_all_pairs(threads: int, dtype: torch.dtype) -> None:
    rng = random.Random(threads * 1000 + (dtype == torch.bfloat16))
    for case in range(24):
        args = _random_case(rng, dtype, seed=case)
        ours = split_attention._attention_cpu(*args)
        ref = _all_pairs_reference(*args)
        assert torch.equal(_bits(ours), _bits(ref)), f"case {case}: {[a for a in args[3:5]]}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_and_decode_of_a_padded_batch_match_the_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    b, hq, hkv, t, d = 3, 6, 2, 140, 16
    q, k, v = (torch.randn(b, h, t, d, generator=gen).to(dtype) for h in (hq, hkv, hkv))
    lengths = torch.tensor([140, 77, 5])
    prefill = ops.attention(
        q, k, v, kv_split_size=32, kv_lengths=lengths, q_positions=torch.arange(t).expand(b, t)
    )
    positions = torch.arange(t).expand(b, t)
    ref = _all_pairs_reference(q, k, v, True, 32, positions, lengths, d**-0.5)
    assert torch.equal(_bits(prefill), _bits(ref))
    for pos in (0, 4, 31, 32, 76, 100, 139):
        dec = ops.attention(
            q[:, :, pos : pos + 1],
            k,
            v,
            kv_split_size=32,
            q_positions=torch.full((b, 1), pos),
            kv_lengths=(lengths.clamp_max(pos + 1)),
        )
        # Every row, also one whose sequence ended before pos (it sees its whole sequence).
        assert torch.equal(_bits(dec[:, :, 0]), _bits(prefill[:, :, pos])), f"position {pos}"


def test_visible_prefix_is_the_attention_mask() -> None:
    """The per-row prefix used to pick pairs agrees with the boolean mask it replaces."""
    gen = torch.Generator().manual_seed(5)
    b, tq, tk, group = 3, 7, 40, 2
    kv_lengths = torch.tensor([40, 13, 7])
    q_positions = torch.randint(0, 45, (b, tq), generator=gen)
    q_positions[0, 0] = -1  # a query before every key sees none
    rows = group * tq
    for causal in (True, False):
        limit = split_attention._visible_prefix(q_positions, kv_lengths, tq, rows, rows, causal)
        mask = ops.attention_mask(q_positions[:, torch.arange(rows) % tq], kv_lengths, tk, causal)
        prefix = torch.arange(tk)[None, None, :] < limit[:, :, None]
        assert torch.equal(prefix, mask.expand_as(prefix))


def test_gradients_match_the_reference_and_sdpa() -> None:
    """Gradients are not bitwise equal to the dense computation's (the row max is a constant
    here, and the pair sums are accumulated in another order): they agree to fp32 rounding,
    and with torch's SDPA, under batch_invariant() as in training."""
    gen = torch.Generator().manual_seed(11)
    b, hq, hkv, t, d = 2, 4, 2, 150, 24
    base = [torch.randn(b, h, t, d, generator=gen) for h in (hq, hkv, hkv)]
    go = torch.randn(b, hq, t, d, generator=gen)
    lengths = torch.tensor([150, 90])
    positions = torch.arange(t).expand(b, t)

    def grads(fn):
        leaves = [x.clone().requires_grad_() for x in base]
        with batch_invariant():
            fn(*leaves).backward(go)
        return [x.grad for x in leaves]

    ours = grads(
        lambda q, k, v: ops.attention(
            q, k, v, kv_split_size=32, q_positions=positions, kv_lengths=lengths
        )
    )
    ref = grads(
        lambda q, k, v: _all_pairs_reference(q, k, v, True, 32, positions, lengths, d**-0.5)
    )
    mask = ops.attention_mask(positions, lengths, t, True)[:, None]
    sdpa = grads(
        lambda q, k, v: F.scaled_dot_product_attention(
            q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask
        )
    )
    for name, a, r, s in zip("qkv", ours, ref, sdpa, strict=True):
        assert a.abs().max() > 0, f"d{name} is zero"
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5, msg=f"d{name} vs all pairs")
        torch.testing.assert_close(a, s, rtol=1e-4, atol=1e-4, msg=f"d{name} vs SDPA")
    # Keys beyond a row's length get no gradient at all.
    assert torch.equal(ours[1][1, :, 90:], torch.zeros_like(ours[1][1, :, 90:]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_query_ranges_give_the_bits_of_one_pass(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long sequence is computed a range of queries at a time (`MAX_SCORES`): the same bits
    as one pass and as the dense reference, each pass within its score budget."""
    passes: list[int] = []
    one_pass = split_attention._attention_cpu_pass

    def recorded(q, k, *rest, **kwargs):
        passes.append(q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2])
        return one_pass(q, k, *rest, **kwargs)

    rng = random.Random(7)
    for case in range(16):
        q, k, v, causal, split, pos, lengths, scale = _random_case(rng, dtype, seed=100 + case)
        budget = rng.choice([1, 600, 2000])  # down to one block of queries per pass
        whole = split_attention._attention_cpu(q, k, v, causal, split, pos, lengths, scale)
        monkeypatch.setattr(split_attention, "_attention_cpu_pass", recorded)
        passes.clear()
        ranged = split_attention._attention_cpu(
            q, k, v, causal, split, pos, lengths, scale, max_scores=budget
        )
        monkeypatch.setattr(split_attention, "_attention_cpu_pass", one_pass)
        ref = _all_pairs_reference(q, k, v, causal, split, pos, lengths, scale)
        assert torch.equal(_bits(ranged), _bits(whole)), f"case {case}"
        assert torch.equal(_bits(ranged), _bits(ref)), f"case {case}"
        per_block = q.shape[0] * q.shape[1] * Q_BLOCK * k.shape[2]  # the least a pass does
        assert len(passes) == -(-q.shape[2] // max(Q_BLOCK, budget // per_block * Q_BLOCK))
        assert max(passes) <= max(budget, per_block), (budget, passes)
