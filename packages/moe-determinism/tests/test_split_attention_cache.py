"""Split attention reading a slot KV cache in place (``kv_slots``) gives the bits of the same
attention over a copy of the batch's rows, decoding and prefilling, whether or not the cache
length is a whole number of splits (when it is not, the op copies the rows itself)."""

from __future__ import annotations

import pytest
import torch

from tandem.moe_determinism import MoEDeterminismError, ops


def _case(seed: int, max_len: int, tq: int, split: int, slots: tuple[int, ...] = (7, 2, 5, 0)):
    g = torch.Generator().manual_seed(seed)
    slots_total, hkv, hq, d = 20, 2, 4, 8
    kc = torch.randn(slots_total, hkv, max_len, d, generator=g)
    vc = torch.randn(slots_total, hkv, max_len, d, generator=g)
    slots = torch.tensor(slots)
    lengths = torch.randint(tq, max_len + 1, (4,), generator=g)
    lengths[1] = max_len  # one row fills its slot
    q = torch.randn(4, hq, tq, d, generator=g)
    q_pos = lengths[:, None] - tq + torch.arange(tq)[None, :]
    return kc, vc, slots, lengths, q, q_pos, split


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def _copied_and_in_place(
    kc: torch.Tensor,
    vc: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    q: torch.Tensor,
    q_pos: torch.Tensor,
    split: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over a copy of the batch's cache rows (whole splits up to the longest row),
    and over the cache read in place."""
    tk = min(-(-int(lengths.max()) // split) * split, kc.shape[2])
    copied = ops.attention(
        q,
        kc[slots, :, :tk],
        vc[slots, :, :tk],
        kv_split_size=split,
        q_positions=q_pos,
        kv_lengths=lengths,
    )
    in_place = ops.attention(
        q, kc, vc, kv_split_size=split, q_positions=q_pos, kv_lengths=lengths, kv_slots=slots
    )
    return copied, in_place


@pytest.mark.parametrize(
    ("max_len", "tq", "slots"),
    [
        (256, 1, (7, 2, 5, 0)),  # decoding: one query block per KV head
        (256, 3, (7, 2, 5, 0)),
        (256, 1, (19, 2, 5, 0)),  # slots far apart
        (256, 1, (2, 3, 2, 0)),  # two rows read one slot
        (256, 37, (7, 2, 5, 0)),
        (200, 1, (7, 2, 5, 0)),  # cache not a whole number of splits: a copy of the rows
        (200, 21, (7, 2, 5, 0)),
    ],
)
def test_reading_the_cache_in_place_equals_attention_over_copied_rows(
    max_len: int, tq: int, slots: tuple[int, ...]
):
    kc, vc, slots, lengths, q, q_pos, split = _case(max_len + tq, max_len, tq, 32, slots)
    copied, in_place = _copied_and_in_place(kc, vc, slots, lengths, q, q_pos, split)
    assert torch.equal(_bits(in_place), _bits(copied))
    # and the rows are right, not merely equal: a float64 softmax attention per row
    group = q.shape[1] // kc.shape[1]
    for i, slot in enumerate(slots.tolist()):
        n = int(lengths[i])
        k = kc[slot, :, :n].double().repeat_interleave(group, 0)
        v = vc[slot, :, :n].double().repeat_interleave(group, 0)
        s = q[i].double() @ k.transpose(1, 2) / q.shape[-1] ** 0.5
        s = s.masked_fill(torch.arange(n)[None, None, :] > q_pos[i][None, :, None], float("-inf"))
        ref = torch.softmax(s, -1) @ v
        torch.testing.assert_close(in_place[i].double(), ref, rtol=1e-5, atol=1e-5)


def test_decoding_ignores_what_the_cache_holds_past_a_rows_last_split() -> None:
    """A slot's cache beyond a row's last split may hold anything (a longer sequence that held
    the slot before, even non-finite values): those splits are never part of the result."""
    kc, vc, slots, lengths, q, q_pos, split = _case(5, 256, 1, 32)
    lengths[:] = torch.tensor([40, 256, 90, 33])
    q_pos = lengths[:, None] - 1
    for slot, n in zip(slots.tolist(), lengths.tolist(), strict=True):
        end = -(-n // split) * split
        kc[slot, :, end:] = float("inf")
        vc[slot, :, end:] = float("nan")
    copied, in_place = _copied_and_in_place(kc, vc, slots, lengths, q, q_pos, split)
    assert bool(torch.isfinite(copied).all())
    assert torch.equal(_bits(in_place), _bits(copied))


def test_cache_reads_need_lengths_and_one_slot_per_row() -> None:
    kc, vc, slots, lengths, q, _, split = _case(0, 128, 1, 32)
    with pytest.raises(MoEDeterminismError, match="kv_slots needs kv_lengths"):
        ops.attention(q, kc, vc, kv_split_size=split, kv_slots=slots)
    with pytest.raises(MoEDeterminismError, match="kv_slots must be"):
        ops.attention(q, kc, vc, kv_split_size=split, kv_lengths=lengths, kv_slots=slots[:2])


def test_gathers_of_aligned_rows_equal_plain_gathers() -> None:
    """`gather_aligned` returns what `index_select` does, with aligned rows for a view of an
    `aligned_zeros` buffer, and falls back for a view whose padding columns are not there."""
    from tandem.moe_determinism.ops.tiles import _aligned, aligned_zeros, gather_aligned

    gen = torch.Generator().manual_seed(0)
    cache = aligned_zeros((6, 64, 24), torch.float32)
    cache.copy_(torch.randn(6, 64, 24, generator=gen))
    index = torch.tensor([4, 0, 4, 5])
    got = gather_aligned(cache, index)
    assert torch.equal(got, cache.index_select(0, index)) and _aligned(got)
    # a narrow view of a wider tensor whose last row ends at the storage's end
    wide = torch.randn(3, 8, 32, generator=gen)
    tail = wide[..., 8:]  # rows of 24 at a stride of 32: columns past it are not padding
    got = gather_aligned(tail, torch.tensor([2, 1]))
    assert torch.equal(got, tail.index_select(0, torch.tensor([2, 1])))
