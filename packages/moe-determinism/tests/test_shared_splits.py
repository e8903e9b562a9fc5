"""KV splits that several cache slots hold with the same bits (a copied prompt) are read once
per step for all of them: the KV cache keeps track of which slots hold which splits
(`KVCache.origins`), attention stacks the rows that read a split into shared GEMM blocks,
and every row's result keeps its bits."""

from __future__ import annotations

import pytest
import torch

from tandem.moe_determinism import MoEConfig, MoEDeterminismError, batch_invariant, ops
from tandem.moe_determinism.model.cache import KVCache
from tandem.moe_determinism.ops.shared_splits import SharedSplits

SPLIT = 16
CFG = MoEConfig(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    moe_intermediate_size=32,
    num_experts=4,
    num_experts_per_tok=2,
    kv_split_size=SPLIT,
)


def _append(cache: KVCache, slot: int, n: int, gen: torch.Generator) -> None:
    """Write ``n`` new random keys and values at the end of ``slot``, as a forward does."""
    start = int(cache.lengths[slot])
    for layer in (*cache.keys, *cache.values):
        layer[slot, :, start : start + n] = torch.randn(
            layer.shape[1], n, layer.shape[3], generator=gen
        )
    cache.lengths[slot] += n


def _check_origins(cache: KVCache) -> int:
    """Every origin other than the slot itself holds the same split whole, with the same bits;
    returns how many (slot, split) entries name another slot."""
    named = 0
    for i in range(cache.max_slots):
        for s, o in enumerate(cache.origins[i].tolist()):
            if o == i:
                continue
            named += 1
            end = (s + 1) * SPLIT
            assert int(cache.lengths[i]) >= end and int(cache.lengths[o]) >= end, (i, s, o)
            for layer in (*cache.keys, *cache.values):
                assert torch.equal(layer[i, :, end - SPLIT : end], layer[o, :, end - SPLIT : end])
    return named


def test_origins_follow_copies_truncations_and_resets() -> None:
    """Random copies, appends, truncations and resets: after each, every slot named as an
    origin holds the split whole and bit for bit (a freed origin hands its role over)."""
    gen = torch.Generator().manual_seed(0)
    cache = KVCache(CFG, max_slots=6, max_len=128)
    most = 0
    for _ in range(300):
        op = int(torch.randint(0, 4, (1,), generator=gen))
        a, b = torch.randint(0, 6, (2,), generator=gen).tolist()
        la, lb = int(cache.lengths[a]), int(cache.lengths[b])
        if op == 0 and a != b and la > lb:
            cache.copy_prefix(a, b, int(torch.randint(lb, la + 1, (1,), generator=gen)))
        elif op == 1 and la < 128:
            _append(
                cache, a, int(torch.randint(1, min(40, 128 - la) + 1, (1,), generator=gen)), gen
            )
        elif op == 2:
            cache.truncate(a, int(torch.randint(0, la + 1, (1,), generator=gen)))
        elif op == 3 and int(torch.randint(0, 4, (1,), generator=gen)) == 0:
            cache.reset(a)
        most = max(most, _check_origins(cache))
    assert most >= 10  # copies did make slots share splits


def test_a_copy_shares_only_whole_splits_it_wrote() -> None:
    gen = torch.Generator().manual_seed(1)
    cache = KVCache(CFG, max_slots=3, max_len=128)
    _append(cache, 0, 70, gen)
    cache.copy_prefix(0, 1, 40)  # splits 0 and 1 whole; split 2 only in part
    assert cache.origins[1, :3].tolist() == [0, 0, 1]
    _append(cache, 1, 2, gen)
    cache.copy_prefix(1, 2, 35)  # slot 1's origin is slot 0: slot 2 names slot 0 too
    assert cache.origins[2, :3].tolist() == [0, 0, 2]
    cache.truncate(0, 20)  # slot 0 keeps split 0 whole, no longer split 1: slot 1 takes over
    assert cache.origins[:, 1].tolist() == [0, 1, 1]
    assert cache.origins[:, 0].tolist() == [0, 0, 0]
    cache.reset(0)
    assert cache.origins[:, 0].tolist() == [0, 1, 1]
    assert _check_origins(cache) == 2


def _shared_cache(rows: int, gen: torch.Generator) -> tuple[KVCache, torch.Tensor]:
    """``rows`` slots of which the first ``rows - 2`` copied a 70-token prompt from the first,
    then each went on with its own tokens; the last two are unrelated."""
    cache = KVCache(CFG, max_slots=rows + 3, max_len=192)
    slots = torch.randperm(rows + 3, generator=gen)[:rows]
    donor = int(slots[0])
    _append(cache, donor, 70, gen)
    for slot in slots[1:-2].tolist():
        cache.copy_prefix(donor, slot, 70)
    for slot in slots.tolist():
        _append(cache, slot, int(torch.randint(1, 90, (1,), generator=gen)), gen)
    return cache, slots


@pytest.mark.parametrize(("rows", "tq"), [(12, 1), (5, 1), (12, 3), (6, 37)])
def test_rows_reading_shared_splits_once_get_the_same_bits(rows: int, tq: int) -> None:
    """Decoding (one query: rows of eight sharers per block, twelve rows overflow into a
    second block), a short prefill (three queries: two per block) and a long prefill (several
    query blocks, read from the origins unstacked) all equal the per-row computation."""
    gen = torch.Generator().manual_seed(rows * 100 + tq)
    cache, slots = _shared_cache(rows, gen)
    kc, vc = cache.keys[0], cache.values[0]
    lengths = cache.lengths[slots]
    q = torch.randn(rows, CFG.num_attention_heads, tq, CFG.head_dim, generator=gen)
    q_pos = lengths[:, None] - tq + torch.arange(tq)[None, :]
    common = {
        "kv_split_size": SPLIT,
        "q_positions": q_pos,
        "kv_lengths": lengths,
        "kv_slots": slots,
    }
    origins = cache.origins[slots]
    assert int((origins != slots[:, None]).sum()) == (rows - 3) * (70 // SPLIT)
    with batch_invariant():
        plain = ops.attention(q, kc, vc, **common)
        shared = ops.attention(q, kc, vc, kv_origins=origins, **common)
    assert torch.equal(shared.view(torch.int32), plain.view(torch.int32))


def test_shared_blocks_hold_every_pair_once() -> None:
    """Pairs reading the same split fill blocks `block_rows // live` at a time; packing then
    unpacking gives every pair's rows back."""
    kv_block_of = torch.tensor([5, 2, 5, 5, 9, 2, 5, 5])  # split 5 read by five pairs
    packed = SharedSplits.build(kv_block_of, live=2, block_rows=8)  # four pairs per block
    assert packed.kv_block.tolist() == [2, 5, 5, 9]
    x = torch.arange(1, 8 * 2 * 3 + 1, dtype=torch.float32).view(8, 2, 3)
    blocks = packed.pack(x)
    assert blocks.shape == (4, 8, 3)
    assert torch.equal(packed.unpack(blocks), x)
    assert int((blocks != 0).any(-1).sum()) == 8 * 2  # the other rows are zero padding
    with pytest.raises(MoEDeterminismError, match="do not fit"):
        SharedSplits.build(kv_block_of, live=9, block_rows=8)


def test_origins_need_a_slot_cache_and_their_shape() -> None:
    gen = torch.Generator().manual_seed(2)
    cache, slots = _shared_cache(5, gen)
    kc, vc = cache.keys[0], cache.values[0]
    lengths = cache.lengths[slots]
    q = torch.randn(5, 4, 1, 8, generator=gen)
    origins = cache.origins[slots]
    with pytest.raises(MoEDeterminismError, match="kv_origins needs kv_slots"):
        ops.attention(
            q, kc[slots], vc[slots], kv_split_size=SPLIT, kv_lengths=lengths, kv_origins=origins
        )
    for bad, what in ((origins[:, :3], "must be"), (origins + 100, "slots in")):
        with pytest.raises(MoEDeterminismError, match=what):
            ops.attention(
                q, kc, vc, kv_split_size=SPLIT, kv_lengths=lengths, kv_slots=slots, kv_origins=bad
            )
