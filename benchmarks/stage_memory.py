"""Peak host memory of each stage against model size, and the largest model each stage fits.

For each size, a Qwen3-MoE checkpoint (byte vocabulary, 8 experts, top 2, random weights) is
written by one process, then every stage runs in a fresh process on it with the least work
that exercises its whole memory (the real stage functions, nothing mocked):

- ``load``: `load_policy` (shard by shard from memory-mapped safetensors);
- ``eval``: load, then `evaluate_policy` on one held-out task (the embedded engine);
- ``midtrain``: `midtrain_policy` from ``model.path`` for two steps (weights, gradients and
  AdamW's two moments);
- ``rl``: load, then `reinforce` for one synchronous step of one group (trainer with AdamW,
  the engine's own copy, the weight store's published base).

Batches, KV cache (2 slots of 1,024 tokens) and micro-batches are kept at their least, so
what grows with size is what grows with the weights; activations and the KV cache come on
top at a run's own settings (the KV cache: max_slots x max_len x layers x 2 x
num_key_value_heads x head_dim x 4 bytes). A stage's figure is its process's peak RSS less
the RSS it had after its imports. A least-squares line over the sizes gives bytes per
parameter and a fixed part per stage, and from it the largest model whose weights-bound
memory fits ``--memory-gib`` (default: this machine's memory less ``--headroom-gib``).
Weights are held in fp32.

    uv run python benchmarks/stage_memory.py [--sizes 16 64 192] [--memory-gib 24]

``--context`` gives the other axis, the trainer's scoring pass against context length with
a real vocabulary, before and after chunked logits and activation checkpointing
(`context_memory.py`):

    uv run python benchmarks/stage_memory.py --context [--lengths 1024 4096 8192 16384]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("load", "eval", "midtrain", "rl")
GIB = 1 << 30


def shape(millions: float) -> dict[str, int]:
    """A Qwen3-MoE shape of about ``millions`` parameters (8 experts of width = hidden)."""
    best: dict[str, int] = {}
    for layers in (2, 4, 6, 8, 12, 16):
        for hidden in range(128, 4097, 128):  # whole pairs of 64-wide heads
            params = layers * (4 * hidden * hidden + 24 * hidden * hidden) + 2 * 266 * hidden
            if params >= millions * 1e6:
                if not best or abs(params - millions * 1e6) < abs(best["params"] - millions * 1e6):
                    best = {"layers": layers, "hidden": hidden, "params": params}
                break
    return best


def _config(ckpt: Path, out: Path):
    import msgspec

    from tandem.app.config import load_config
    from tandem.app.pipeline_config import PipelineConfig

    demo = load_config(PipelineConfig, ROOT / "configs" / "demo.toml", [f"model.path={ckpt}"])
    data = msgspec.to_builtins(demo)
    data["run"].update(output_dir=str(out), name="memory")
    data["env"]["allow_unsandboxed"] = True
    # the least activations and KV cache there can be: what remains grows with the weights
    data["midtrain"].update(
        steps=2, batch_size=1, window=128, transcripts=2, transcript_fraction=0.0,
        code_bytes=200_000,
    )  # fmt: skip
    data["rl"].update(mode="sync", steps=1, groups_per_step=1, group_size=2)
    data["trainer"]["loss"].update(micro_batch_size=1)
    data["eval"].update(tasks=1, samples=1)
    data["engine"].update(max_slots=2, max_len=1024, max_new_tokens=16)
    return msgspec.convert(data, PipelineConfig)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(stage: str, ckpt: Path, out: Path, millions: float) -> None:
    """Run one stage in this process and print its figures as one JSON line."""
    import torch

    from tandem.orchestrator import (
        RunHooks,
        evaluate_policy,
        load_policy,
        midtrain_policy,
        reinforce,
    )

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    if stage == "make":
        from tandem.moe_determinism import MoEConfig
        from tandem.orchestrator.inference.tokenizer import ByteTokenizer
        from tandem.orchestrator.policy import build_model, save_policy

        s = shape(millions)
        heads = max(1, s["hidden"] // 64)
        config = MoEConfig(
            vocab_size=266,
            hidden_size=s["hidden"],
            num_hidden_layers=s["layers"],
            num_attention_heads=heads,
            num_key_value_heads=max(1, heads // 2),
            head_dim=64,
            moe_intermediate_size=s["hidden"],
            num_experts=8,
            num_experts_per_tok=2,
            max_position_embeddings=4096,
        )
        model = build_model(config, ByteTokenizer(), seed=0)
        save_policy(model, ckpt, stage="benchmark")
        params = sum(p.numel() for p in model.parameters())
        print(json.dumps({"params": params}))
        return
    config = _config(ckpt, out)
    base = _rss()
    t0 = time.perf_counter()
    if stage == "load":
        load_policy(ckpt)
    elif stage == "eval":
        evaluate_policy(load_policy(ckpt), config)
    elif stage == "midtrain":
        midtrain_policy(config)
    elif stage == "rl":
        parity = RunHooks(reward=lambda s: float(sum(s.tokens[-8:]) % 2))
        summary = reinforce(load_policy(ckpt), config, hooks=parity)
        assert summary.steps_done == 1, summary
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"extra": peak - base, "base": base, "seconds": time.perf_counter() - t0}))


def _run(args: list[str]) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return my - slope * mx, slope


def _mem_total() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise SystemExit("cannot read MemTotal from /proc/meminfo")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[16, 64, 192], help="millions")
    ap.add_argument("--memory-gib", type=float, default=None)
    ap.add_argument("--headroom-gib", type=float, default=2.0)
    ap.add_argument("--child", nargs=4, metavar=("STAGE", "CKPT", "OUT", "MILLIONS"))
    ap.add_argument("--context", action="store_true", help="the context-length axis instead")
    ap.add_argument("--lengths", type=int, nargs="+", default=None, help="with --context")
    ap.add_argument("--vocabs", type=int, nargs="+", default=None, help="with --context")
    ap.add_argument("--limit-gib", type=float, default=14.0, help="with --context: per point")
    args = ap.parse_args()
    if args.context:
        import context_memory

        context_memory.run(
            args.lengths or list(context_memory.LENGTHS),
            args.vocabs or list(context_memory.VOCABS),
            args.limit_gib,
        )
        return
    if args.child:
        stage, ckpt, out, millions = args.child
        child(stage, Path(ckpt), Path(out), float(millions))
        return
    if len(args.sizes) < 2:
        raise SystemExit("--sizes needs at least two sizes to fit a line")
    memory = args.memory_gib * GIB if args.memory_gib else _mem_total() - args.headroom_gib * GIB
    rows: dict[str, list[tuple[int, int, float]]] = {s: [] for s in STAGES}
    with tempfile.TemporaryDirectory(prefix="stage-memory-") as tmp:
        for millions in args.sizes:
            ckpt, out = Path(tmp) / f"ckpt{millions:g}", Path(tmp) / f"out{millions:g}"
            params = _run(["make", str(ckpt), str(out), str(millions)])["params"]
            for stage in STAGES:
                got = _run([stage, str(ckpt), str(out), str(millions)])
                rows[stage].append((params, got["extra"], got["seconds"]))
                print(
                    f"{params / 1e6:7.1f}M params  {stage:<8} +{got['extra'] / GIB:6.2f} GiB "
                    f"({got['extra'] / params:5.1f} B/param)  {got['seconds']:6.1f} s",
                    flush=True,
                )
    print(f"\nfits in {memory / GIB:.1f} GiB (fp32 weights; line fitted over the sizes above):")
    print(f"{'stage':<9} {'B/param':>8} {'fixed GiB':>10} {'largest model':>14}")
    for stage in STAGES:
        fixed, per_param = fit([p for p, _, _ in rows[stage]], [e for _, e, _ in rows[stage]])
        largest = (memory - max(fixed, 0.0)) / per_param if per_param > 0 else float("inf")
        print(f"{stage:<9} {per_param:8.1f} {fixed / GIB:10.2f} {largest / 1e9:12.2f} B")


if __name__ == "__main__":
    main()
