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
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tandem.moe_determinism.errors import MoEDeterminismError
from tandem.moe_determinism.ops.gemm import fixed_shape_bmm
from tandem.moe_determinism.ops.reduction import fixed_sum, tree_sum

Q_BLOCK = 16
"""Query rows (heads x queries of one KV head) per fixed-shape GEMM block."""
KV_SPLIT_SIZE = 64
"""Default keys per split."""


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise MoEDeterminismError(
            "attention expects q [B, Hq, Tq, D], k and v [B, Hkv, Tk, D]; got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    b, hq, _, d = q.shape
    if k.shape[0] != b or v.shape[0] != b or k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
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
) -> torch.Tensor:
    """Scaled dot-product attention, invariant per query. Returns [B, Hq, Tq, D].

    q: [B, Hq, Tq, D]; k, v: [B, Hkv, Tk, D] (Hq a multiple of Hkv: grouped-query attention).
    q_positions [B, Tq]: each query's position on the key axis (default: the last Tq keys).
    kv_lengths [B]: valid keys per batch row (default Tk); keys beyond are ignored.
    """
    _check_shapes(q, k, v)
    if kv_split_size <= 0:
        raise MoEDeterminismError(f"kv_split_size must be positive, got {kv_split_size}")
    q_positions, kv_lengths = _default_positions(q, k, q_positions, kv_lengths)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if q.is_cuda:
        from tandem.moe_determinism.kernels.dispatch import cuda_attention

        return cuda_attention(q, k, v, causal, kv_split_size, q_positions, kv_lengths, scale)
    return _attention_reference(q, k, v, causal, kv_split_size, q_positions, kv_lengths, scale)


def _attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    split: int,
    q_positions: torch.Tensor,
    kv_lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    b, hq, tq, d = q.shape
    hkv, tk, dv = k.shape[1], k.shape[2], v.shape[3]
    group = hq // hkv
    acc_dtype = torch.float32 if q.dtype in (torch.bfloat16, torch.float16) else q.dtype
    rows = group * tq
    n_rb = max(1, -(-rows // Q_BLOCK))
    n_sp = max(1, -(-tk // split))
    rows_p, keys_p = n_rb * Q_BLOCK, n_sp * split

    # Query rows of one KV head: (head in group, query) flattened, zero-padded to whole blocks.
    qr = q.reshape(b, hkv, rows, d)
    qr = F.pad(qr, (0, 0, 0, rows_p - rows)).view(b, hkv, n_rb, 1, Q_BLOCK, d)
    kp = F.pad(k, (0, 0, 0, keys_p - tk)).view(b, hkv, 1, n_sp, split, d)
    vp = F.pad(v, (0, 0, 0, keys_p - tk)).view(b, hkv, 1, n_sp, split, dv)

    blocks = b * hkv * n_rb * n_sp
    q_blk = qr.expand(b, hkv, n_rb, n_sp, Q_BLOCK, d).reshape(blocks, Q_BLOCK, d)
    k_blk = kp.expand(b, hkv, n_rb, n_sp, split, d).reshape(blocks, split, d)
    scores = fixed_shape_bmm(q_blk, k_blk.transpose(1, 2))  # fixed [Q_BLOCK, D] @ [D, split]
    scores = scores.to(acc_dtype).view(b, hkv, n_rb, n_sp, Q_BLOCK, split) * scale

    # Visibility of each (row, key): rows map back to queries by row % Tq.
    query_of_row = torch.arange(rows_p, device=q.device) % tq
    pos = q_positions[:, query_of_row]  # [B, rows_p]
    visible = attention_mask(pos, kv_lengths, keys_p, causal).expand(b, rows_p, keys_p).clone()
    visible[:, rows:, 0] = True  # padding rows: keep one key so they stay finite
    visible = visible.view(b, 1, n_rb, Q_BLOCK, n_sp, split).permute(0, 1, 2, 4, 3, 5)
    scores = scores.masked_fill(~visible, float("-inf"))

    # Softmax over all keys: exact max, then per-split fixed sums and a tree over splits.
    m = scores.amax(dim=(3, 5), keepdim=True)
    p = torch.exp(scores - m)
    denom = tree_sum(fixed_sum(p, -1), dim=3)  # [b, hkv, n_rb, Q_BLOCK]

    v_blk = vp.expand(b, hkv, n_rb, n_sp, split, dv).reshape(blocks, split, dv)
    partial = fixed_shape_bmm(p.to(q.dtype).reshape(blocks, Q_BLOCK, split), v_blk)
    partial = partial.to(acc_dtype).view(b, hkv, n_rb, n_sp, Q_BLOCK, dv)
    out = tree_sum(partial, dim=3) / denom[..., None]  # [b, hkv, n_rb, Q_BLOCK, dv]
    out = out.reshape(b, hkv, rows_p, dv)[:, :, :rows]
    return out.reshape(b, hq, tq, dv).to(q.dtype)
