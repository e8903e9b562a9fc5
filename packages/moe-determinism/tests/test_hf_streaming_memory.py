"""Benchmark (slow): loading a checkpoint of over 2 GB streams, peak host memory about one
shard above the model's own size.

A fresh interpreter writes a ~2.4 GB fp32 Qwen3-MoE checkpoint in 512 MB shards; another
loads it with `load_hf` and reports its peak resident memory (``ru_maxrss``) against its
resident memory before the load. Run with ``uv run pytest -m slow -s`` and the path of this
file; it prints the figures.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SHARD = 512 * 2**20
WRITE = f"""
import sys, torch
from tandem.moe_determinism import MoEConfig, MoETransformer, save_hf
cfg = MoEConfig(vocab_size=32000, hidden_size=1024, num_hidden_layers=8, num_attention_heads=8,
    num_key_value_heads=2, head_dim=128, moe_intermediate_size=1024, num_experts=20,
    num_experts_per_tok=2)
with torch.device("meta"):
    model = MoETransformer(cfg)
model = model.to_empty(device="cpu")
with torch.no_grad():
    for p in model.parameters():
        p.normal_(0.0, 0.02)
save_hf(model, sys.argv[1], max_shard_bytes={SHARD})
"""
LOAD = """
import json, resource, sys, time
import torch
from tandem.moe_determinism import load_hf
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()
before = rss()
t0 = time.perf_counter()
model = load_hf(sys.argv[1])
seconds = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
size = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"before": before, "peak": peak, "model": size, "seconds": seconds}))
"""


@pytest.mark.slow
def test_streaming_load_peak_is_model_plus_about_one_shard(tmp_path: Path) -> None:
    ckpt = tmp_path / "big"
    subprocess.run([sys.executable, "-c", WRITE, str(ckpt)], check=True, timeout=900)
    on_disk = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    largest = max(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    assert on_disk >= 2 * 10**9
    out = subprocess.run(
        [sys.executable, "-c", LOAD, str(ckpt)],
        check=True,
        timeout=900,
        capture_output=True,
        text=True,
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    extra = r["peak"] - r["before"] - r["model"]
    gib = 2**30
    print(
        f"checkpoint {on_disk / gib:.2f} GiB in shards of <= {largest / gib:.2f} GiB; load "
        f"{r['seconds']:.1f} s; peak RSS - RSS before = {(r['peak'] - r['before']) / gib:.2f} "
        f"GiB = model {r['model'] / gib:.2f} GiB + {extra / gib:.2f} GiB"
    )
    assert extra <= largest * 1.25
