"""Decode steps of the engine's model with a group's shared KV splits read once, against once
per row.

Fills a KV cache the way the engine does for GRPO groups: one sample of each group computes
the shared prefix (the prompt, first call and file it returns: about 470 tokens in the demo),
the others copy it (`KVCache.copy_prefix`, which records the copies in `KVCache.origins`),
then every sample feeds its own continuation. Then times one-token decode steps of all rows
with the model under `batch_invariant()`, interleaved, once with the recorded origins and
once with them hidden (every row reads its own slot: one gather and GEMM block per row and
split, the work done without origins), and checks that both give the same logits bit for
bit. Printed: rows, (row, split) pairs each way,
median milliseconds per decode step, and the ratio.

    uv run python benchmarks/shared_splits.py [--groups 5] [--group-size 8] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tandem.app.config import load_config
from tandem.app.pipeline_config import PipelineConfig
from tandem.moe_determinism import MoETransformer, batch_invariant
from tandem.moe_determinism.model.cache import KVCache
from tandem.orchestrator import build_model
from tandem.orchestrator.inference.tokenizer import ByteTokenizer


def fill_cache(
    model: MoETransformer, args: argparse.Namespace, gen: torch.Generator
) -> tuple[KVCache, torch.Tensor]:
    """A cache holding ``groups`` groups: a shared prefix each, then a tail per sample."""
    rows = args.groups * args.group_size
    cache = model.new_cache(rows, args.max_len)
    slots = torch.arange(rows)
    for g in range(args.groups):
        donor = g * args.group_size
        prefix = torch.randint(0, 256, (args.prefix,), generator=gen)
        model(prefix, cu_seqlens=torch.tensor([0, args.prefix]), cache=cache, slots=[donor])
        for s in range(donor + 1, donor + args.group_size):
            cache.copy_prefix(donor, s, args.prefix)
    tails = torch.randint(args.tail // 2, args.tail * 3 // 2, (rows,), generator=gen)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), tails.cumsum(0)])
    tokens = torch.randint(0, 256, (int(cu[-1]),), generator=gen)
    model(tokens, cu_seqlens=cu, cache=cache, slots=slots)
    return cache, slots


def pairs(cache: KVCache, slots: torch.Tensor, origins: torch.Tensor) -> tuple[int, int]:
    """(row, split) pairs a decode step computes, and the distinct splits they read."""
    n_splits = (cache.lengths[slots] + 1 + cache.split - 1) // cache.split
    rows = [(int(s), k) for s, n in zip(slots, n_splits, strict=True) for k in range(int(n))]
    read = {
        (int(origins[s, k]) if (k + 1) * cache.split <= cache.lengths[s] else s, k) for s, k in rows
    }
    return len(rows), len(read)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", default="configs/demo.toml")
    parser.add_argument("--groups", type=int, default=5)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prefix", type=int, default=470, help="shared tokens per group")
    parser.add_argument("--tail", type=int, default=450, help="mean own tokens per sample")
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    if min(args.groups, args.group_size, args.prefix, args.tail, args.repeats) < 1:
        parser.error("--groups, --group-size, --prefix, --tail and --repeats must be >= 1")
    if args.prefix + args.tail * 3 // 2 + 1 > args.max_len:
        parser.error(f"--prefix + 1.5 x --tail must stay below --max-len {args.max_len}")

    torch.set_num_threads(1)  # as an engine actor runs
    cfg = load_config(PipelineConfig, args.config)
    model = build_model(cfg.model, ByteTokenizer(), seed=cfg.midtrain.init_seed).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad(), batch_invariant():
        cache, slots = fill_cache(model, args, gen)
    lengths = cache.lengths[slots].clone()
    recorded = cache.origins.clone()
    own = torch.arange(cache.max_slots)[:, None].expand_as(recorded).clone()
    next_tokens = torch.randint(0, 256, (slots.numel(),), generator=gen)
    cu = torch.arange(slots.numel() + 1)

    def decode(origins: torch.Tensor) -> tuple[float, torch.Tensor]:
        cache.origins.copy_(origins)
        t0 = time.perf_counter()
        out = model(next_tokens, cu_seqlens=cu, cache=cache, slots=slots)
        seconds = time.perf_counter() - t0
        for s, n in zip(slots.tolist(), lengths.tolist(), strict=True):
            cache.truncate(s, n)  # back to where it was: every repeat decodes the same step
        return seconds, out.logits

    times: dict[str, list[float]] = {"shared": [], "own": []}
    with torch.no_grad(), batch_invariant():
        _, want = decode(own)
        for _ in range(args.repeats):
            for name, origins in (("shared", recorded), ("own", own)):
                seconds, logits = decode(origins)
                if not torch.equal(logits.view(torch.int32), want.view(torch.int32)):
                    raise SystemExit(f"logits differ with {name} origins: a bug")
                times[name].append(seconds)
    n_pairs, n_read = pairs(cache, slots, recorded)
    shared_ms, own_ms = (1e3 * statistics.median(times[k]) for k in ("shared", "own"))
    print(
        f"{slots.numel()} rows ({args.groups} groups x {args.group_size}), shared prefix "
        f"{args.prefix} tokens, {int(lengths.float().mean())} tokens per row on average"
    )
    print(f"(row, split) pairs per layer: {n_pairs}; distinct splits read with origins: {n_read}")
    print(f"decode step, each row its own splits:  {own_ms:8.2f} ms (median of {args.repeats})")
    print(f"decode step, shared splits read once:  {shared_ms:8.2f} ms")
    print(f"ratio: {own_ms / shared_ms:.2f}x, logits bit for bit equal")


if __name__ == "__main__":
    main()
