"""CPU split attention shared between threads: whole sequences, or whole KV heads, per thread.

The CPU split attention is thousands of small fixed-shape products with element-wise work
between them, each step too small to share between threads on its own (only the products
were: the rest ran on the calling thread). A prefill or a training batch is instead cut
into parts that each thread computes whole, single-threaded (`workers.run_parts`). Every
query's result depends only on its own sequence and KV head, never on which others are
computed with it, so each part gives the bits the whole would: who computes a query
changes, never how.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from tandem.moe_determinism.ops import workers

PARALLEL_SCORES = 1 << 20
"""Attention scores (batch x query heads x queries x keys) from which the work is cut into
parts: a prefill or a training batch, not a decode step (a few thousand scores)."""


def thread_parts(
    q: torch.Tensor, k: torch.Tensor, keys: int, heads_ok: bool
) -> tuple[bool, list[tuple[int, int]]] | None:
    """How to share one attention between `workers.tile_threads()` threads: (by batch rows,
    row ranges) or (by KV heads, head ranges); None to compute it on this thread alone.

    Whole rows, or whole KV heads when they make more parts (``heads_ok``: not with a slot
    cache, whose head slices would be copied whole)."""
    threads = workers.tile_threads()
    b, hq, tq, _ = q.shape
    if threads == 1 or b * hq * tq * keys < PARALLEL_SCORES:
        return None
    heads = k.shape[1] if heads_ok else 1
    by_rows = min(b, threads) >= min(heads, threads)
    count = b if by_rows else heads
    if count < 2:
        return None
    parts = min(threads, count)
    return by_rows, [(i * count // parts, (i + 1) * count // parts) for i in range(parts)]


def compute(
    whole: Callable[..., torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    split: int,
    q_positions: torch.Tensor,
    kv_lengths: torch.Tensor,
    scale: float,
    kv_slots: torch.Tensor | None,
    cache_keys: int,
    kv_origins: torch.Tensor | None,
    *,
    with_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``whole(...)`` (the split attention's CPU path, same arguments), in parts when it is
    large enough and there is more than one thread."""
    cached = kv_slots is not None
    plan = thread_parts(q, k, cache_keys if cached else k.shape[2], not cached)
    if with_lse:
        whole = partial(whole, with_lse=True)
    if plan is None:
        return whole(
            q, k, v, causal, split, q_positions, kv_lengths, scale, kv_slots, cache_keys, kv_origins
        )
    by_rows, bounds = plan
    if by_rows:  # a slot cache stays whole: each row names its slot
        parts = [
            partial(
                whole,
                q[lo:hi],
                k if cached else k[lo:hi],
                v if cached else v[lo:hi],
                causal,
                split,
                q_positions[lo:hi],
                kv_lengths[lo:hi],
                scale,
                kv_slots[lo:hi] if kv_slots is not None else None,
                cache_keys,
                kv_origins[lo:hi] if kv_origins is not None else None,
            )
            for lo, hi in bounds
        ]
        return concat(workers.run_parts(parts), dim=0)
    group = q.shape[1] // k.shape[1]  # a KV head's query heads go with it
    parts = [
        partial(
            whole,
            q[:, lo * group : hi * group],
            k[:, lo:hi],
            v[:, lo:hi],
            causal,
            split,
            q_positions,
            kv_lengths,
            scale,
        )
        for lo, hi in bounds
    ]
    return concat(workers.run_parts(parts), dim=1)


def concat(
    parts: list[torch.Tensor] | list[tuple[torch.Tensor, ...]], dim: int
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Parts of one attention put back together along ``dim``: outputs, or (output,
    log-sum-exp) pairs, each concatenated (the log-sum-exp has no last, feature dim)."""
    if isinstance(parts[0], torch.Tensor):
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)  # type: ignore[arg-type]
    return tuple(
        p[0] if len(parts) == 1 else torch.cat(p, dim=dim) for p in zip(*parts, strict=True)
    )
