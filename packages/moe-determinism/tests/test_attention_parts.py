"""CPU attention shared between threads, whole sequences or whole KV heads per thread, gives
the bits of the same attention computed on one thread, with and without a slot cache, and
the same gradients; the parts really run on several threads, each single-threaded."""

from __future__ import annotations

import threading

import pytest
import torch

from tandem.moe_determinism import ops
from tandem.moe_determinism.ops import attention_parts, split_attention, workers


@pytest.fixture
def three_threads(monkeypatch: pytest.MonkeyPatch):
    """Three torch threads and every attention, however small, cut into parts."""
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    monkeypatch.setattr(attention_parts, "PARALLEL_SCORES", 0)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _one_thread(fn):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def _recording_parts(monkeypatch: pytest.MonkeyPatch, parts: int) -> list[tuple[str, int, int]]:
    """(thread, torch threads, tile threads) of every part computed from now on. Each of the
    `parts` parts waits for the others to start: they can only all finish if each runs on a
    thread of its own (a thread taking two would wait forever: the barrier times out)."""
    seen: list[tuple[str, int, int]] = []
    whole = split_attention._attention_cpu
    together = threading.Barrier(parts, timeout=60)

    def recorded(*args, **kwargs):
        name = threading.current_thread().name
        seen.append((name, torch.get_num_threads(), workers.tile_threads()))
        together.wait()
        return whole(*args, **kwargs)

    monkeypatch.setattr(split_attention, "_attention_cpu", recorded)
    return seen


@pytest.mark.parametrize(
    ("b", "hq", "hkv", "tq", "tk"),
    [
        (5, 4, 2, 37, 37),  # whole sequences per thread (prefill)
        (7, 6, 3, 1, 90),  # decoding with more rows than threads
        (1, 6, 3, 70, 70),  # one sequence: whole KV heads per thread
        (2, 4, 4, 20, 45),  # fewer rows than threads: KV heads
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parts_give_the_bits_of_one_thread(
    three_threads, monkeypatch: pytest.MonkeyPatch, b, hq, hkv, tq, tk, dtype
) -> None:
    g = torch.Generator().manual_seed(b * 100 + tk)
    q = torch.randn(b, hq, tq, 16, generator=g).to(dtype)
    k = torch.randn(b, hkv, tk, 16, generator=g).to(dtype)
    v = torch.randn(b, hkv, tk, 16, generator=g).to(dtype)
    lengths = torch.randint(tq, tk + 1, (b,), generator=g)
    q_pos = lengths[:, None] - tq + torch.arange(tq)[None, :]

    def attend() -> torch.Tensor:
        return ops.attention(q, k, v, kv_split_size=16, q_positions=q_pos, kv_lengths=lengths)

    alone = _one_thread(attend)
    parts = max(min(b, 3), min(hkv, 3))  # whole rows or whole KV heads, whichever make more
    seen = _recording_parts(monkeypatch, parts)
    shared = attend()
    assert torch.equal(shared, alone)
    assert len(seen) == parts and len({name for name, _, _ in seen}) == parts
    assert all(count == 1 and tiles == 1 for _, count, tiles in seen)  # each part alone


def test_parts_read_a_slot_cache_with_shared_prompts(
    three_threads, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill from a slot cache whose rows share their first split (`kv_origins`)."""
    g = torch.Generator().manual_seed(3)
    slots_total, hkv, hq, d, split, max_len, tq = 9, 2, 4, 8, 16, 64, 5
    kc = torch.randn(slots_total, hkv, max_len, d, generator=g)
    vc = torch.randn(slots_total, hkv, max_len, d, generator=g)
    slots = torch.tensor([4, 1, 7, 0, 2, 8])
    origins = slots[:, None].repeat(1, max_len // split)
    origins[:, 0] = 4  # every row reads its first split from slot 4
    kc[slots, :, :split], vc[slots, :, :split] = kc[4, :, :split], vc[4, :, :split]
    lengths = torch.randint(split + tq, max_len + 1, (6,), generator=g)
    q = torch.randn(6, hq, tq, d, generator=g)
    q_pos = lengths[:, None] - tq + torch.arange(tq)[None, :]

    def attend() -> torch.Tensor:
        return ops.attention(
            q, kc, vc, kv_split_size=split, q_positions=q_pos, kv_lengths=lengths,
            kv_slots=slots, kv_origins=origins,
        )  # fmt: skip

    alone = _one_thread(attend)
    seen = _recording_parts(monkeypatch, 3)  # rows: heads would copy the whole cache
    assert torch.equal(attend(), alone)
    assert len({name for name, _, _ in seen}) == 3


def test_gradients_flow_through_every_part(three_threads) -> None:
    g = torch.Generator().manual_seed(5)
    leaves = [torch.randn(4, 4, 40, 16, generator=g) for _ in range(1)] + [
        torch.randn(4, 2, 40, 16, generator=g) for _ in range(2)
    ]
    grads = []
    outs = []
    for run in (lambda f: _one_thread(f), lambda f: f()):
        q, k, v = (t.clone().requires_grad_() for t in leaves)

        def forward_backward(q=q, k=k, v=v) -> torch.Tensor:
            out = ops.attention(q, k, v, kv_split_size=16)
            (out * torch.arange(out.numel()).view_as(out).sin()).sum().backward()
            return out

        outs.append(run(forward_backward).detach())
        grads.append([q.grad, k.grad, v.grad])
    assert torch.equal(outs[0], outs[1])
    for alone, shared in zip(*grads, strict=True):
        assert alone is not None and shared is not None
        torch.testing.assert_close(shared, alone, rtol=1e-6, atol=1e-6)


def test_the_callers_autograd_modes_hold_in_the_parts(
    three_threads, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode step under `no_grad` (or `inference_mode`) records no graph in the workers
    either; a training forward records none in its parts (its gradient comes from torch's
    fused attention, `attention_grad`) and returns an output that takes a gradient."""
    modes: list[tuple[bool, bool]] = []
    whole = split_attention._attention_cpu

    def recorded(*args, **kwargs):
        modes.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled()))
        out = whole(*args, **kwargs)
        first = out[0] if isinstance(out, tuple) else out  # (output, log-sum-exp) for a graph
        modes.append((first.requires_grad, first.is_inference()))
        return out

    monkeypatch.setattr(split_attention, "_attention_cpu", recorded)
    q = torch.randn(4, 4, 30, 16, requires_grad=True)
    k, v = torch.randn(4, 2, 30, 16), torch.randn(4, 2, 30, 16)
    with torch.no_grad():
        ops.attention(q, k, v, kv_split_size=16)
    assert modes == [(False, False)] * 6  # 3 parts: modes inside, then their outputs
    modes.clear()
    with torch.inference_mode():
        ops.attention(q.detach(), k, v, kv_split_size=16)
    assert modes == [(False, True)] * 6
    modes.clear()
    out = ops.attention(q, k, v, kv_split_size=16)
    assert modes == [(False, False)] * 6 and out.requires_grad
