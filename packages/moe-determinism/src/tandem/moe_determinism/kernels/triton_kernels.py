"""Batch-invariant Triton kernels: matmul, row sum, RMSNorm, log-softmax, split attention.

The invariance recipe (Thinking Machines, "Defeating Nondeterminism in LLM Inference"):
one fixed tile configuration per dtype and device, no split-K, one row per program for
row reductions with a fixed chunk order, and attention that walks the KV axis in splits of
a fixed *size* from the sequence's first key. Each output element's reduction order then
depends only on its own row's length, never on the batch. fp32 products use IEEE precision
(no TF32), matching torch's default for fp32 matmul.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.moe_determinism.errors import MoEDeterminismError

NEG_BIG: tl.constexpr = tl.constexpr(-1.0e30)  # masked score: exp(NEG_BIG - m) == 0, never NaN


def _matmul_tiles(device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps): fixed per device kind, never per shape."""
    if device.type == "cuda":
        return 64, 128, 32, 4
    return 16, 16, 16, 1  # interpreter: small tiles keep CPU tests quick


@triton.jit
def _matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    s_ab,
    s_am,
    s_ak,
    s_bb,
    s_bk,
    s_bn,
    s_cb,
    s_cm,
    s_cn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_b = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_base = a_ptr + pid_b * s_ab
    b_base = b_ptr + pid_b * s_bb
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        a = tl.load(
            a_base + offs_m[:, None] * s_am + kk[None, :] * s_ak,
            mask=(offs_m[:, None] < M) & (kk[None, :] < K),
            other=0.0,
        )
        b = tl.load(
            b_base + kk[:, None] * s_bk + offs_n[None, :] * s_bn,
            mask=(kk[:, None] < K) & (offs_n[None, :] < N),
            other=0.0,
        )
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    c = acc.to(c_ptr.dtype.element_ty)
    tl.store(
        c_ptr + pid_b * s_cb + offs_m[:, None] * s_cm + offs_n[None, :] * s_cn,
        c,
        mask=(offs_m[:, None] < M) & (offs_n[None, :] < N),
    )


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[M, K] @ [K, N] or [G, M, K] @ [G, K, N] with a fixed tile configuration."""
    squeeze = a.dim() == 2
    a3, b3 = (a[None], b[None]) if squeeze else (a, b)
    if a3.dim() != 3 or b3.dim() != 3 or a3.shape[0] != b3.shape[0] or a3.shape[2] != b3.shape[1]:
        raise MoEDeterminismError(
            f"triton matmul: incompatible shapes {tuple(a.shape)} @ {tuple(b.shape)}"
        )
    g, m, k = a3.shape
    n = b3.shape[2]
    c = torch.empty(g, m, n, dtype=a.dtype, device=a.device)
    bm, bn, bk, warps = _matmul_tiles(a.device)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), g)
    _matmul_kernel[grid](
        a3,
        b3,
        c,
        m,
        n,
        k,
        *a3.stride(),
        *b3.stride(),
        *c.stride(),
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        IEEE=a.dtype == torch.float32,
        num_warps=warps,
    )
    return c[0] if squeeze else c


def _row_block(n: int, device: torch.device) -> int:
    """Chunk width for row kernels: a function of the row length and device only."""
    cap = 1024 if device.type == "cuda" else 64
    return min(cap, triton.next_power_of_2(max(n, 1)))


@triton.jit
def _row_sum_kernel(x_ptr, out_ptr, N, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for off in range(0, N, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + row * stride + cols, mask=cols < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + row, tl.sum(acc, axis=0))


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """fp32 sum over the last dim, one program per row."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    if x2.shape[0]:
        _row_sum_kernel[(x2.shape[0],)](
            x2, out, x2.shape[1], x2.stride(0), BLOCK=_row_block(x2.shape[1], x.device)
        )
    return out.reshape(x.shape[:-1])


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, N, stride, eps, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for off in range(0, N, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride + cols, mask=cols < N, other=0.0).to(tl.float32)
        acc += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / N + eps)
    for off in range(0, N, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride + cols, mask=cols < N, other=0.0).to(tl.float32)
        y = (x * rstd).to(y_ptr.dtype.element_ty)
        if HAS_W:
            w = tl.load(w_ptr + cols, mask=cols < N, other=0.0)
            y = (w.to(tl.float32) * y.to(tl.float32)).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + row * stride + cols, y, mask=cols < N)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.empty_like(x2)
    if x2.shape[0]:
        w = weight.contiguous() if weight is not None else x2
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            w,
            y,
            x2.shape[1],
            x2.stride(0),
            eps,
            HAS_W=weight is not None,
            BLOCK=_row_block(x2.shape[1], x.device),
        )
    return y.reshape(x.shape)


@triton.jit
def _log_softmax_kernel(x_ptr, y_ptr, N, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    m_vec = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    for off in range(0, N, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride + cols, mask=cols < N, other=float("-inf")).to(tl.float32)
        m_vec = tl.maximum(m_vec, x)
    m = tl.max(m_vec, axis=0)
    s_vec = tl.zeros((BLOCK,), dtype=tl.float32)
    for off in range(0, N, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride + cols, mask=cols < N, other=float("-inf")).to(tl.float32)
        s_vec += tl.exp(x - m)
    log_s = tl.log(tl.sum(s_vec, axis=0))
    for off in range(0, N, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride + cols, mask=cols < N, other=0.0).to(tl.float32)
        tl.store(
            y_ptr + row * stride + cols, (x - m - log_s).to(y_ptr.dtype.element_ty), mask=cols < N
        )


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """Log-softmax over the last dim, one program per row."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.empty_like(x2)
    if x2.shape[0]:
        _log_softmax_kernel[(x2.shape[0],)](
            x2, y, x2.shape[1], x2.stride(0), BLOCK=_row_block(x2.shape[1], x.device)
        )
    return y.reshape(x.shape)


@triton.jit
def _attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    qpos_ptr,
    kvlen_ptr,
    Hq,
    GROUP,
    Tq,
    D,
    scale,
    s_qb,
    s_qh,
    s_qt,
    s_kb,
    s_kh,
    s_kt,
    s_vb,
    s_vh,
    s_vt,
    s_ob,
    s_oh,
    s_ot,
    s_pb,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
    USE_DOT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hq
    h = pid_bh % Hq
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    row_ok = offs_m < Tq
    q = tl.load(
        q_ptr + b * s_qb + h * s_qh + offs_m[:, None] * s_qt + offs_d[None, :],
        mask=row_ok[:, None] & (offs_d[None, :] < D),
        other=0.0,
    )
    qpos = tl.load(qpos_ptr + b * s_pb + offs_m, mask=row_ok, other=0)
    kv_len = tl.load(kvlen_ptr + b)
    m_i = tl.full((BLOCK_M,), NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for n0 in range(0, kv_len, BLOCK_N):
        keys = n0 + offs_n
        key_ok = keys < kv_len
        k = tl.load(
            k_ptr + b * s_kb + hk * s_kh + keys[:, None] * s_kt + offs_d[None, :],
            mask=key_ok[:, None] & (offs_d[None, :] < D),
            other=0.0,
        )
        v = tl.load(
            v_ptr + b * s_vb + hk * s_vh + keys[:, None] * s_vt + offs_d[None, :],
            mask=key_ok[:, None] & (offs_d[None, :] < D),
            other=0.0,
        )
        if USE_DOT:
            if IEEE:  # noqa: SIM108 - constexpr branch, kept explicit for the Triton frontend
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
        else:
            s = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
        s = s * scale
        visible = key_ok[None, :]
        if CAUSAL:
            visible = visible & (keys[None, :] <= qpos[:, None])
        s = tl.where(visible, s, NEG_BIG)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        p = tl.where(visible, p, 0.0)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if USE_DOT:
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
        else:
            pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        o_ptr + b * s_ob + h * s_oh + offs_m[:, None] * s_ot + offs_d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (offs_d[None, :] < D),
    )


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    kv_split_size: int,
    q_positions: torch.Tensor,
    kv_lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Split attention: one program per (query block, head), KV walked in fixed-size splits.

    On the GPU the products are `tl.dot` on fixed tiles (each output element's order is set
    by the tile shape, not by the other rows). The CPU interpreter evaluates `tl.dot` with
    numpy, whose result for a row can depend on its position in the tile, so there the same
    kernel forms the products as broadcast multiply + per-row sums.

    Splits past a query's last visible key change nothing (their weights are exactly 0 and
    the running max is unchanged), so prefill and cached decode agree bit for bit.
    """
    b, hq, tq, d = q.shape
    hkv = k.shape[1]
    if kv_split_size < 16 or kv_split_size & (kv_split_size - 1):
        raise MoEDeterminismError(
            f"triton attention needs a power-of-two kv_split_size >= 16, got {kv_split_size}"
        )
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    qpos = q_positions.to(torch.int64).contiguous()
    kvlen = kv_lengths.to(torch.int64).contiguous()
    o = torch.empty_like(q)
    block_m = 64 if q.is_cuda else 16
    grid = (triton.cdiv(tq, block_m), b * hq)
    _attention_kernel[grid](
        q,
        k,
        v,
        o,
        qpos,
        kvlen,
        hq,
        hq // hkv,
        tq,
        d,
        scale,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        o.stride(0),
        o.stride(1),
        o.stride(2),
        qpos.stride(0),
        CAUSAL=causal,
        BLOCK_M=block_m,
        BLOCK_N=kv_split_size,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        IEEE=q.dtype == torch.float32,
        USE_DOT=q.is_cuda,
        num_warps=4 if q.is_cuda else 1,
    )
    return o
