"""Batch-invariant attention with a fixed KV split size.

Per query, the order of every reduction is fixed by the query's own data:

* scores: one fixed-shape GEMM per (block of `Q_BLOCK` query rows) x (split of
  `kv_split_size` keys), so a score does not depend on how many queries or keys are
  computed together;
* softmax: the max is exact; the sum of exponentials is a fixed-order sum inside each split
  and an adjacent-pair tree over splits;
* values: one fixed-shape GEMM per (query block, KV split), then the same tree over splits.

Keys a query may not see contribute exact zeros. A query scored in prefill (all keys
present, later ones masked) and the same query decoded with a KV cache (only earlier keys
present) therefore see identical splits plus, in prefill, extra all-zero splits at the end,
which the tree absorbs without changing a bit. Splitting by a fixed *size* (never a fixed
*number* of splits) is what keeps the split boundaries where they were.

Grouped-query attention is handled by stacking the query heads of a KV head as extra rows.
Only the forward must be invariant: with a gradient wanted, the forward records no graph and
the gradient is torch's fused attention's (`attention_grad`).
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F

from tandem.moe_determinism.errors import MoEDeterminismError
from tandem.moe_determinism.ops import attention_grad, attention_parts, tiles
from tandem.moe_determinism.ops.gemm import fixed_shape_bmm, fixed_shape_bmm_indexed, needs_graph
from tandem.moe_determinism.ops.reduction import fixed_sum
from tandem.moe_determinism.ops.shared_splits import SharedSplits
from tandem.moe_determinism.ops.split_grid import GatherBlocks, SplitTreeSum

Q_BLOCK = 16
"""Query rows (heads x queries of one KV head) per fixed-shape GEMM block."""
KV_SPLIT_SIZE = 64
"""Default keys per split."""
MAX_SCORES = 1 << 24
"""Scores (batch x query heads x queries x keys) per pass of the CPU path, so its gathered
key and value blocks stay about 0.5 GB, not the context's square (8 GB a layer at 16k)."""


def _check_shapes(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_slots: torch.Tensor | None
) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise MoEDeterminismError(
            "attention expects q [B, Hq, Tq, D], k and v [B, Hkv, Tk, D]; got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    b, hq, _, d = q.shape
    rows = b
    if kv_slots is not None:
        if kv_slots.shape != (b,):
            raise MoEDeterminismError(
                f"attention: kv_slots must be [B] = {(b,)}, got {tuple(kv_slots.shape)}"
            )
        rows = k.shape[0]  # a slot cache: batch row i reads slot kv_slots[i]
    if (
        k.shape[0] != rows
        or v.shape[0] != rows
        or k.shape[1] != v.shape[1]
        or k.shape[2] != v.shape[2]
    ):
        raise MoEDeterminismError(
            f"attention: k {tuple(k.shape)} and v {tuple(v.shape)} must share batch, heads "
            f"and length with each other and batch with q {tuple(q.shape)}"
        )
    if k.shape[3] != d:
        raise MoEDeterminismError(f"attention: q head dim {d} != k head dim {k.shape[3]}")
    if hq % k.shape[1]:
        raise MoEDeterminismError(
            f"attention: {hq} query heads is not a multiple of {k.shape[1]} KV heads"
        )


def attention_mask(
    q_positions: torch.Tensor, kv_lengths: torch.Tensor, num_keys: int, causal: bool
) -> torch.Tensor:
    """Boolean [B, Tq, Tk]: key j is visible to a query at position p if j < kv_length and,
    when causal, j <= p. Positions index the key axis (a KV cache stores token t at slot t)."""
    keys = torch.arange(num_keys, device=q_positions.device)
    visible = keys[None, None, :] < kv_lengths[:, None, None]
    if causal:
        visible = visible & (keys[None, None, :] <= q_positions[:, :, None])
    return visible


def _default_positions(
    q: torch.Tensor,
    k: torch.Tensor,
    q_positions: torch.Tensor | None,
    kv_lengths: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    b, _, tq, _ = q.shape
    tk = k.shape[2]
    if kv_lengths is None:
        kv_lengths = torch.full((b,), tk, dtype=torch.long, device=q.device)
    if q_positions is None:
        # Bottom-right alignment: the last query sees the last key.
        q_positions = kv_lengths[:, None] - tq + torch.arange(tq, device=q.device)[None, :]
    if q_positions.shape != (b, tq):
        raise MoEDeterminismError(
            f"attention: q_positions must be [B, Tq] = {(b, tq)}, got {tuple(q_positions.shape)}"
        )
    if kv_lengths.shape != (b,):
        raise MoEDeterminismError(f"attention: kv_lengths must be [B] = {(b,)}")
    return q_positions.to(q.device), kv_lengths.to(q.device)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    kv_split_size: int = KV_SPLIT_SIZE,
    q_positions: torch.Tensor | None = None,
    kv_lengths: torch.Tensor | None = None,
    scale: float | None = None,
    kv_slots: torch.Tensor | None = None,
    kv_origins: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention, invariant per query. Returns [B, Hq, Tq, D].

    q: [B, Hq, Tq, D]; k, v: [B, Hkv, Tk, D] (Hq a multiple of Hkv: grouped-query attention).
    q_positions [B, Tq]: each query's position on the key axis (default: the last Tq keys).
    kv_lengths [B]: valid keys per batch row (default Tk); keys beyond are ignored.
    kv_slots [B]: k and v are a KV cache [slots, Hkv, max_len, D] and batch row i reads slot
    ``kv_slots[i]`` (``kv_lengths`` required). The CPU path then reads the key splits it needs
    straight from the cache instead of a copy of every row's keys; the result is the same.
    kv_origins [B, cache splits] (with kv_slots): for row i and split s, a cache slot whose
    split s holds the same bits as slot ``kv_slots[i]``'s (`KVCache.origins`). On the CPU,
    rows reading the same split then share its gather and GEMM blocks; the result is the same.
    """
    _check_shapes(q, k, v, kv_slots)
    if kv_split_size <= 0:
        raise MoEDeterminismError(f"kv_split_size must be positive, got {kv_split_size}")
    tk = 0  # with kv_slots: the cache keys the rows read
    if kv_slots is not None:
        if kv_lengths is None:
            raise MoEDeterminismError("attention: kv_slots needs kv_lengths")
        # the keys any row may see, in whole splits: what a copy of the rows would hold
        tk = min(-(-int(kv_lengths.max()) // kv_split_size) * kv_split_size, k.shape[2])
        if q.is_cuda or k.shape[2] % kv_split_size:
            k, v, kv_slots = k[kv_slots, :, :tk], v[kv_slots, :, :tk], None
            kv_origins = None
        elif kv_origins is not None:
            _check_origins(kv_origins, kv_slots, k.shape[0], k.shape[2] // kv_split_size)
    elif kv_origins is not None:
        raise MoEDeterminismError("attention: kv_origins needs kv_slots")
    q_positions, kv_lengths = _default_positions(q, k, q_positions, kv_lengths)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if q.is_cuda:
        from tandem.moe_determinism.kernels.dispatch import cuda_attention

        return cuda_attention(q, k, v, causal, kv_split_size, q_positions, kv_lengths, scale)
    run = partial(
        attention_parts.compute,
        _attention_cpu,
        q, k, v, causal, kv_split_size, q_positions, kv_lengths, scale, kv_slots, tk, kv_origins,
    )  # fmt: skip
    if causal and kv_slots is None and needs_graph(q, k, v):
        # the forward's bits without a graph; the gradient from torch's fused kernel, given
        # this forward's output and log-sum-exp (no second forward in backward)
        return attention_grad.ExactForwardAttention.apply(
            q, k, v, q_positions, kv_lengths, scale, partial(run, with_lse=True)
        )
    return run()


def _check_origins(
    origins: torch.Tensor, slots: torch.Tensor, cache_slots: int, splits: int
) -> None:
    if origins.shape != (slots.shape[0], splits):
        raise MoEDeterminismError(
            f"attention: kv_origins must be [B, cache splits] = {(slots.shape[0], splits)}, "
            f"got {tuple(origins.shape)}"
        )
    if origins.numel() and (int(origins.min()) < 0 or int(origins.max()) >= cache_slots):
        raise MoEDeterminismError(f"attention: kv_origins must be slots in [0, {cache_slots})")


def _visible_prefix(
    q_positions: torch.Tensor,
    kv_lengths: torch.Tensor,
    tq: int,
    rows: int,
    rows_p: int,
    causal: bool,
) -> torch.Tensor:
    """[B, rows_p] long: row r sees exactly the keys j < limit[r] (`attention_mask` as a prefix).

    Rows are (head in group, query) pairs, so row r is query r % Tq. Padding rows (r >= rows)
    always keep key 0 so their softmax stays finite (a NaN there would leak into the key and
    value gradients through 0 * NaN)."""
    b = kv_lengths.shape[0]
    limit = kv_lengths[:, None].expand(b, rows_p)
    if causal:
        query_of_row = torch.arange(rows_p, device=q_positions.device) % tq
        limit = torch.minimum(limit, q_positions[:, query_of_row] + 1)
    limit = limit.clone()
    limit[:, rows:] = limit[:, rows:].clamp_min(1)
    return limit


def _attention_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    split: int,
    q_positions: torch.Tensor,
    kv_lengths: torch.Tensor,
    scale: float,
    kv_slots: torch.Tensor | None = None,
    cache_keys: int = 0,
    kv_origins: torch.Tensor | None = None,
    max_scores: int = MAX_SCORES,
    *,
    with_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`_attention_cpu_pass` over ranges of queries of at most ``max_scores`` scores each.
    Every reduction of a query is its own row's (a fixed-shape GEMM gives a row the same bits
    in any block; the max and the tree over splits are per row, the split grid set by the
    keys), so the ranges give one pass's bits, in memory linear in the context.
    ``with_lse``: also each query's log-sum-exp of its scaled scores [B, Hq, Tq] (fp32)."""
    b, hq, tq, _ = q.shape
    keys = k.shape[2] if kv_slots is None else cache_keys
    step = max(Q_BLOCK, max_scores // max(1, b * hq * keys) // Q_BLOCK * Q_BLOCK)
    rest = (kv_lengths, scale, kv_slots, cache_keys, kv_origins)
    one_pass = partial(_attention_cpu_pass, with_lse=with_lse)
    parts = [
        one_pass(
            q[:, :, lo : lo + step], k, v, causal, split, q_positions[:, lo : lo + step], *rest
        )
        for lo in range(0, tq, step)
    ]
    return attention_parts.concat(parts, dim=2)


def _attention_cpu_pass(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    split: int,
    q_positions: torch.Tensor,
    kv_lengths: torch.Tensor,
    scale: float,
    kv_slots: torch.Tensor | None = None,
    cache_keys: int = 0,
    kv_origins: torch.Tensor | None = None,
    *,
    with_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Split attention on the CPU, computing only the (query block, KV split) pairs in which
    some row sees some key.

    The reductions are those of the dense block grid [B, Hkv, row blocks, splits]: every
    per-split sum and partial output is scattered back into a zero-filled grid and reduced
    by the same tree over splits. A skipped pair contributes exact zeros there (x + 0 == x),
    and -inf to the row max, exactly as when it was computed and masked; so the result is
    bit for bit that of the dense grid, while a causal prefill does about half the work.
    Each computed pair is still one fixed-shape [Q_BLOCK, D] @ [D, split] GEMM.

    When every row fits in one block (decoding: a KV head's few query heads), the work after
    each GEMM is done on the real rows only: row-wise operations give a row the same bits
    whichever other rows they run with, and the second GEMM gets its padding rows back as
    zeros, keeping its fixed shape.

    With ``kv_slots`` (k and v a slot cache whose length is a whole number of splits), the
    key and value splits are read from the cache rows of the batch's slots, as if the first
    ``cache_keys`` keys of those rows had been copied out first: the same blocks, the same
    bits. With ``kv_origins`` as well, a row reads each split from the slot its origin
    names, and the rows of one block (decoding) that read the same split are stacked into
    shared GEMM blocks (`SharedSplits`): a GRPO group's samples read their common prompt
    once per step instead of once each. Otherwise, when no graph is recorded, the pairs of
    one split are put side by side and their GEMMs read it in place
    (`fixed_shape_bmm_indexed`) instead of each gathering a copy of its keys and values.
    """
    b, hq, tq, d = q.shape
    hkv, dv = k.shape[1], v.shape[3]
    tk = k.shape[2] if kv_slots is None else cache_keys
    group = hq // hkv
    acc_dtype = torch.float32 if q.dtype in (torch.bfloat16, torch.float16) else q.dtype
    rows = group * tq
    n_rb = max(1, -(-rows // Q_BLOCK))
    n_sp = max(1, -(-tk // split))
    rows_p, keys_p = n_rb * Q_BLOCK, n_sp * split
    live = rows if n_rb == 1 else Q_BLOCK  # rows of each block worth computing past a GEMM
    dev = q.device

    # Which pairs to compute: a block is active for a split if its widest row reaches into it.
    limit = _visible_prefix(q_positions, kv_lengths, tq, rows, rows_p, causal)
    limit = limit.view(b, n_rb, Q_BLOCK)
    split_start = torch.arange(n_sp, device=dev) * split
    active = split_start[None, None, :] < limit.amax(-1)[:, :, None]  # [b, n_rb, n_sp]
    active = active[:, None].expand(b, hkv, n_rb, n_sp).reshape(-1)
    pair = active.nonzero().squeeze(1)  # flat index into the (b, hkv, n_rb, n_sp) grid
    sp_of = pair % n_sp
    block_of = pair // n_sp  # flat (b, hkv, row block)
    head_of = block_of // n_rb  # flat (b, hkv)
    if kv_slots is None:
        kv_block_of = head_of * n_sp + sp_of  # flat (b, hkv, split)
    else:  # the same split of the cache row: flat (slot, hkv, split of the whole cache)
        if kv_origins is None:
            slot_of = kv_slots.to(dev)[head_of // hkv]
        else:  # the slot whose split holds the same bits, shared by the rows that share it
            slot_of = kv_origins.to(dev)[head_of // hkv, sp_of]
        kv_block_of = (slot_of * hkv + head_of % hkv) * (k.shape[2] // split) + sp_of
    shared_rows = kv_origins is not None and n_rb == 1 and 2 * live <= Q_BLOCK
    in_place = not shared_rows and not needs_graph(q, k, v)
    if in_place:  # the pairs of one KV split next to each other: its GEMMs read it in place
        order = torch.argsort(kv_block_of, stable=True)
        pair, sp_of, block_of, kv_block_of = (
            t[order] for t in (pair, sp_of, block_of, kv_block_of)
        )
    row_limit = limit.view(b, 1, n_rb, Q_BLOCK).expand(b, hkv, n_rb, Q_BLOCK)
    row_limit = row_limit.reshape(-1, Q_BLOCK)[:, :live].index_select(0, block_of)

    # Query rows of one KV head: (head in group, query) flattened, zero-padded to whole blocks.
    qr = F.pad(q.reshape(b, hkv, rows, d), (0, 0, 0, rows_p - rows)).reshape(-1, Q_BLOCK, d)
    if keys_p > tk and kv_slots is None:
        k, v = F.pad(k, (0, 0, 0, keys_p - tk)), F.pad(v, (0, 0, 0, keys_p - tk))
    kp, vp = k.reshape(-1, split, d), v.reshape(-1, split, dv)
    if in_place and kv_slots is None:  # aligned once here, not block by block in the GEMMs
        kp, vp = tiles.aligned_rows(kp), tiles.aligned_rows(vp)
    q_blk = GatherBlocks.apply(qr, block_of)
    shared = None
    if shared_rows:
        shared = SharedSplits.build(kv_block_of, live, Q_BLOCK)  # decoding: no graph
        k_blk = tiles.gather_aligned(kp, shared.kv_block)
        scores = shared.unpack(fixed_shape_bmm(shared.pack(q_blk[:, :live]), k_blk.mT))
    elif in_place:
        scores = fixed_shape_bmm_indexed(q_blk, kp, kv_block_of, transposed=True)
    else:
        k_blk = GatherBlocks.apply(kp, kv_block_of)
        scores = fixed_shape_bmm(q_blk, k_blk.transpose(1, 2))  # fixed [Q_BLOCK, D] @ [D, split]
    scores = scores[:, :live].to(acc_dtype) * scale
    keys = sp_of[:, None] * split + torch.arange(split, device=dev)[None, :]
    scores.masked_fill_(keys[:, None, :] >= row_limit[:, :, None], float("-inf"))  # fresh

    # Exact row max over every split (skipped ones hold only -inf). It is a constant for
    # autograd: softmax does not depend on the shift, so its gradient through it is zero.
    blocks = b * hkv * n_rb
    with torch.no_grad():
        m = scores.new_full((blocks * n_sp, live), float("-inf"))
        m.index_copy_(0, pair, scores.amax(-1))
        m = m.view(blocks, n_sp, live).amax(1)
    p = (scores - m.index_select(0, block_of)[:, :, None]).exp_()  # one fresh buffer

    # Per-split fixed sums and partial outputs, reduced over splits by the dense grid's tree.
    denom = SplitTreeSum.apply(fixed_sum(p, -1), pair, block_of, blocks, n_sp)
    p_blk = p.to(q.dtype)
    if shared is not None:
        v_blk = tiles.gather_aligned(vp, shared.kv_block)
        partial = shared.unpack(fixed_shape_bmm(shared.pack(p_blk), v_blk)).to(acc_dtype)
    else:
        if live < Q_BLOCK:  # the second GEMM keeps its fixed shape: padding rows back, as zeros
            p_blk = F.pad(p_blk, (0, 0, 0, Q_BLOCK - live))
        if in_place:
            partial = fixed_shape_bmm_indexed(p_blk, vp, kv_block_of)
        else:
            partial = fixed_shape_bmm(p_blk, GatherBlocks.apply(vp, kv_block_of))
        partial = partial[:, :live].to(acc_dtype)  # [n_act, live, dv]
    out = SplitTreeSum.apply(partial, pair, block_of, blocks, n_sp) / denom[..., None]
    out = out.view(b, hkv, n_rb * live, dv)[:, :, :rows]
    out = out.reshape(b, hq, tq, dv).to(q.dtype)
    if not with_lse:
        return out
    lse = (m + denom.detach().log()).view(b, hkv, n_rb * live)[:, :, :rows]
    return out, lse.reshape(b, hq, tq)
