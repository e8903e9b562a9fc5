"""Weight-delta benchmark: a real optimizer on a transformer/MoE state, measured side by side.

A Qwen3-MoE-shaped model (embeddings, GQA attention, softmax top-2 router over stacked
SwiGLU experts, tied to nothing) of at least 256 MB of bf16 is trained with
torch.optim.Adam on fp32 master weights (next-token loss on Zipf-distributed tokens), and a
bf16 snapshot is taken around one step at each RL learning rate. For each step the script
prints, in one table: the changed fraction, our ratio, the order-0 entropy bound of that
delta, full-snapshot zstd and XOR+zstd ratios, encode and decode+apply GB/s of dense bytes
on one thread and on all, and publish-then-pull wall time of the delta versus the full
snapshot through a LocalStore and an S3 endpoint (moto's server on loopback).

With --gpu (run by scripts/gpu_check.sh) it instead measures the device paths on one Adam
step of a Qwen3-MoE-shaped bf16 state: torch CUDA tensors (torch kernels) and cupy or
other DLPack CUDA arrays (cupy kernels) against the CPU path, bit-exactness and GB/s each,
and which path serves which arrays.

    uv run python benchmarks/delta_sync.py [--mb 256] [--lrs 5e-7,1e-6,2e-6,5e-6,1e-5]
    uv run python benchmarks/delta_sync.py --gpu [--mb 64]
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import socket
import tempfile
import time
import uuid

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tandem.delta_sync import bench, gpu_bench
from tandem.delta_sync.stores import S3Store


class MoEBlock(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, experts: int, ff: int, top_k: int):
        super().__init__()
        self.heads, self.kv_heads, self.top_k = heads, kv_heads, top_k
        hd = d // heads
        self.input_layernorm = nn.RMSNorm(d)
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        self.post_attention_layernorm = nn.RMSNorm(d)
        self.gate = nn.Linear(d, experts, bias=False)
        self.gate_proj = nn.Parameter(torch.randn(experts, ff, d) * 0.02)
        self.up_proj = nn.Parameter(torch.randn(experts, ff, d) * 0.02)
        self.down_proj = nn.Parameter(torch.randn(experts, d, ff) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.input_layernorm(x)
        hd = d // self.heads
        q = self.q_proj(h).view(b, t, self.heads, hd).transpose(1, 2)
        k = self.k_proj(h).view(b, t, self.kv_heads, hd).transpose(1, 2)
        v = self.v_proj(h).view(b, t, self.kv_heads, hd).transpose(1, 2)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, t, d))
        h = self.post_attention_layernorm(x).reshape(b * t, d)
        probs = self.gate(h).float().softmax(-1)
        weights, ids = probs.topk(self.top_k, -1)
        out = torch.zeros_like(h)
        for e in ids.unique().tolist():
            tok, slot = (ids == e).nonzero(as_tuple=True)
            y = F.silu(h[tok] @ self.gate_proj[e].T) * (h[tok] @ self.up_proj[e].T)
            out.index_add_(0, tok, (y @ self.down_proj[e].T) * weights[tok, slot, None])
        return x + out.view(b, t, d)


class MoELM(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, experts: int, ff: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(
            MoEBlock(d, heads=8, kv_heads=2, experts=experts, ff=ff, top_k=2) for _ in range(layers)
        )
        self.norm = nn.RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def build_model(target_bytes: int) -> MoELM:
    vocab, d, experts, ff = 16384, 1024, 16, 512
    per_layer = 2 * (2 * d * d + 2 * d * d // 4 + experts * d + 3 * experts * ff * d)
    layers = max(1, math.ceil((target_bytes - 2 * 2 * vocab * d) / per_layer))
    return MoELM(vocab, d, layers, experts, ff)


def bf16_snapshot(model: nn.Module) -> dict[str, np.ndarray]:
    import ml_dtypes

    return {
        k: v.detach().to(torch.bfloat16).view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        for k, v in model.state_dict().items()
    }


def adam_pairs(model: MoELM, lrs: list[float], warmup: int, batch: int, seq: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    vocab = model.embed_tokens.num_embeddings
    zipf = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64) ** 1.1
    opt = torch.optim.Adam(model.parameters(), lr=lrs[0], betas=(0.9, 0.999))

    def step(lr: float) -> None:
        for g in opt.param_groups:
            g["lr"] = lr
        tokens = torch.multinomial(zipf, batch * (seq + 1), True, generator=gen).view(batch, -1)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(warmup):
        step(float(np.median(lrs)))
    for lr in lrs:
        before = bf16_snapshot(model)
        t = time.perf_counter()
        step(lr)
        print(f"  Adam step at lr {lr:.0e}: {time.perf_counter() - t:.1f} s", flush=True)
        yield lr, before, bf16_snapshot(model)


class S3Factory:
    """A fresh bucket per store on one moto server; cleanup empties them."""

    def __init__(self, endpoint: str) -> None:
        import boto3

        self.creds = {
            "aws_access_key_id": "bench",
            "aws_secret_access_key": "bench",
            "region_name": "us-east-1",
        }
        self.endpoint = endpoint
        self.client = boto3.client("s3", endpoint_url=endpoint, **self.creds)
        self.buckets: list[str] = []

    def __call__(self, tag: str) -> S3Store:
        bucket = f"{tag}-{uuid.uuid4().hex[:10]}"
        self.client.create_bucket(Bucket=bucket)
        self.buckets.append(bucket)
        return S3Store(bucket, "run", endpoint_url=self.endpoint, **self.creds)

    def cleanup(self) -> None:
        for bucket in self.buckets:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
                for obj in page.get("Contents", []):
                    self.client.delete_object(Bucket=bucket, Key=obj["Key"])
            self.client.delete_bucket(Bucket=bucket)
        self.buckets.clear()


def gpu_main(mb: int, lr: float, repeat: int) -> int:
    """The GPU columns: one row per path, and one `gpu_check:` line for the GPU check."""
    shapes = bench.moe_shapes(mb << 20)
    _, base, new = next(bench.adam_snapshots(shapes, [lr], warmup=1))
    dense = sum(a.nbytes for a in new.values())
    print(f"state: {len(new)} bf16 tensors, {dense / 2**20:.0f} MiB; one Adam step at lr {lr:.0e}")
    rows, missing = gpu_bench.measure_paths(base, new, repeat=repeat)
    print(gpu_bench.format_paths(rows))
    for line in missing:
        print(f"not measured: {line}")
    print("gpu_check: " + gpu_bench.figures_line(rows))
    device_rows = [r for r in rows if r.path != "cpu"]
    return 0 if device_rows and all(r.bit_exact is not False for r in device_rows) else 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=256, help="minimum dense bf16 MB of the model")
    ap.add_argument("--lrs", default="5e-7,1e-6,2e-6,5e-6,1e-5")
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--no-s3", action="store_true")
    ap.add_argument("--gpu", action="store_true", help="the device paths vs the CPU path")
    args = ap.parse_args()
    if args.gpu:
        lrs = sorted(float(x) for x in args.lrs.split(","))
        raise SystemExit(gpu_main(args.mb, lrs[len(lrs) // 2], args.repeat + 1))

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's per-request access log
    torch.manual_seed(0)
    model = build_model(args.mb << 20)
    n_params = sum(p.numel() for p in model.parameters())
    expert_params = sum(
        p.numel() for n, p in model.named_parameters() if "_proj" in n and p.dim() == 3
    )
    print(
        f"model: {len(model.layers)} MoE layers, {n_params / 1e6:.1f} M params "
        f"({2 * n_params / 2**20:.0f} MiB bf16, {100 * expert_params / n_params:.0f}% in experts); "
        f"torch.optim.Adam on fp32 masters, {args.workers} worker threads, "
        f"{os.cpu_count()} CPUs",
        flush=True,
    )
    lrs = [float(x) for x in args.lrs.split(",")]
    tmp = tempfile.TemporaryDirectory(prefix="delta-sync-bench-")
    stores: dict = {"local": bench.LocalStoreFactory(tmp.name)}
    server = None
    if not args.no_s3:
        from moto.server import ThreadedMotoServer

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        stores["s3"] = S3Factory(f"http://127.0.0.1:{port}")
    try:
        rows = bench.run(
            adam_pairs(model, lrs, args.warmup, args.batch, args.seq, seed=0),
            workers=args.workers,
            stores=stores,
            repeat=args.repeat,
            echo=lambda s: print("  " + s, flush=True),
        )
    finally:
        if server is not None:
            server.stop()
        tmp.cleanup()
    print()
    print(bench.format_table(rows, args.workers))
    print()
    print(
        "ratio = dense bf16 bytes / compressed bytes; bound = order-0 entropy of the delta "
        "(changed-mask entropy + entropy of bit-pattern differences); delta/full s = publish "
        "then pull, delta vs full snapshot, through the same store (best of --repeat runs)."
    )


if __name__ == "__main__":
    main()
