"""The batch-invariant products' tiles before and today, in one process.

The CPU products cut rows into tiles of `tiles.ROW_TILE` (16) so that a row's bits do not
depend on the batch. Two changes, each kept here as its baseline:

1. Columns and K are cut into even pieces (`tiles.cuts`) of at most 512 columns and 2,048
   terms, where they were cut from the left into pieces of 512 (SmolLM2's 576 as 512 + 64).
   "before" restores those cuts (other bits for K over 512).
2. A product of at least `gemm.LONG_ROW_TILE` rows takes tiles of that many where this
   machine's BLAS gives a row the bits of 16-row tiles (`gemm.tiles_agree`).
   "16-row" is today's cuts without long tiles: the same bits as today, required.

Cases, the sides interleaved:

* the products alone: [3000, K] @ W.T (one thread) and [32, K] @ W.T (two: a decode step)
  for the demo's and SmolLM2-135M's weight shapes, median of ``--repeats``;
* the demo's GRPO step (its config and policy, 4 groups of 8 of its rollouts' shape, one
  thread, as benchmarks/expert_products.py);
* with ``--smollm2``: SmolLM2-135M-Instruct's GRPO step (2 groups x 4 of ``--train-len``
  tokens after a prompt of about 160, or with ``--tail N`` N tokens after a 950-token
  prompt with the tool list, as benchmarks/peers.py trains), its model FLOPs per second
  against this process's one-thread fp32 GEMM peak; and its embedded engine (32 prompts of
  about 960 tokens, two threads, as benchmarks/kv_reads.py): the prefill and a decode step.

"16-row" and "today" must give equal products, weights, tokens and log-probs.

    uv run python benchmarks/long_tiles.py [--policy runs/demo/midtrained] [--smollm2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from kv_reads import report
from smollm2 import VOCAB, default_model, gemm_peak, machine, trainer_groups

from tandem.moe_determinism.ops import gemm, tiles

LONG, K_TILE, CUTS = gemm.LONG_ROW_TILE, tiles.K_TILE, tiles.cuts
SIDES = ("before", "16-row", "today")
SHAPES = [(96, 96), (96, 384), (384, 96), (576, 576), (576, 192), (576, 1536), (1536, 576)]


def cuts_from_the_left(count: int, most: int, dtype: torch.dtype) -> list[tuple[int, int]]:
    """The cuts before change 1: pieces of ``most`` from the left, the rest last."""
    return [(lo, min(lo + most, count)) for lo in range(0, count, most)]


def use(side: str) -> None:
    """Set the module constants (and cut rule) of ``side``: "today" includes the fitted
    tiles of decode steps (benchmarks/fitted_tiles.py), the baselines do not."""
    before = side == "before"
    gemm.LONG_ROW_TILE = LONG if side == "today" else 0
    gemm.FITTED_TILES = side == "today"
    tiles.K_TILE = 512 if before else K_TILE
    tiles.cuts = cuts_from_the_left if before else CUTS


def interleaved(
    runs: dict[str, Callable[[], Any]], repeats: int, setup: Callable[[str], None] = use
) -> tuple[dict[str, list[float]], dict[str, list[Any]]]:
    """Seconds and results of each side's runs, the sides in turn (order flipped every
    round; the first round a warm-up, not kept); ``setup(side)`` before each run, and
    ``setup("today")`` at the end."""
    times: dict[str, list[float]] = {s: [] for s in runs}
    results: dict[str, list[Any]] = {s: [] for s in runs}
    for r in range(repeats + 1):
        for side in list(runs) if r % 2 else list(runs)[::-1]:
            setup(side)
            t0 = time.perf_counter()
            result = runs[side]()
            if r:
                times[side].append(time.perf_counter() - t0)
                results[side].append(result)
    setup("today")
    return times, results


def products_case(args: argparse.Namespace) -> None:
    from tandem.orchestrator.runtime.threads import torch_threads

    gen = torch.Generator().manual_seed(0)
    for rows, threads in ((3000, 1), (32, 2)):
        print(f"\nproducts [{rows}, K] @ W.T, {threads} thread(s), median of {args.repeats}:")
        with torch_threads(threads):
            for k, n in SHAPES:
                a, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
                product = partial(gemm.mm_blocks, a, w.t())
                times, outs = interleaved(dict.fromkeys(SIDES, product), args.repeats)
                equal = torch.equal(outs["16-row"][-1], outs["today"][-1])
                med = {s: statistics.median(times[s]) for s in SIDES}
                flops = 2 * rows * k * n / med["today"] / 1e9
                print(f"  K {k:>4}, N {n:>4}: " + ", ".join(
                    f"{s} {med[s] * 1e3:.2f} ms" for s in SIDES
                ) + f" (before / today {med['before'] / med['today']:.2f}x, today {flops:.0f} "
                    f"GFLOP/s); 16-row = today: {equal}")  # fmt: skip
                if not equal:
                    raise SystemExit("16-row and today's products differ")


def step_case(name: str, trainers: dict[str, Any], groups: list, repeats: int) -> dict:
    from tandem.orchestrator.runtime.threads import torch_threads

    steps = iter(range(1, 10_000))
    with torch_threads(1):
        times, _ = interleaved(
            {s: (lambda s=s: trainers[s].step(groups, version=next(steps))) for s in SIDES},
            repeats,
        )
    print(f"\n{name}, one thread, median of {repeats}:")
    report({s: {"step": t} for s, t in times.items()}, ("step",), {"step": "step s"})
    a, b = (dict(trainers[s].model.named_parameters()) for s in ("16-row", "today"))
    equal = all(torch.equal(a[n], b[n]) for n in a)
    print(f"  16-row and today's weights equal after every step: {equal}")
    if not equal:
        raise SystemExit("16-row and today's weights differ")
    return {s: statistics.median(t) for s, t in times.items()}


def demo_case(args: argparse.Namespace) -> None:
    from expert_products import demo_step_inputs

    from tandem.orchestrator.policy import clone_model
    from tandem.orchestrator.training.trainer import RLTrainer

    cfg, model, groups, trainer_cfg = demo_step_inputs(args.policy, args.sample_tokens)
    trainers = {s: RLTrainer(clone_model(model), trainer_cfg, temperature=1.0) for s in SIDES}
    step_case(f"the demo's GRPO step ({cfg.rl.groups_per_step} groups x {cfg.rl.group_size}, "
              f"{args.sample_tokens} tokens per sample after a 650-token prompt)",
              trainers, groups, args.repeats)  # fmt: skip


def smollm2_case(args: argparse.Namespace) -> None:
    from tandem.grpo import GRPOConfig
    from tandem.orchestrator.config import TrainerConfig
    from tandem.orchestrator.policy import clone_model, load_policy
    from tandem.orchestrator.training.trainer import RLTrainer

    model_dir = Path(args.model) if args.model else default_model()
    model = load_policy(model_dir)
    shape = argparse.Namespace(group_size=4, train_len=args.train_len, tail=args.tail)
    groups = trainer_groups(model, model_dir, shape)
    lengths = f"{args.tail} tokens after a {len(groups[0][0].tokens) - args.tail}-token prompt"
    loss = GRPOConfig(micro_batch_size=4, skip_equal_reward_groups=False)
    cfg = TrainerConfig(lr=1e-6, routing_check_rows=0, logits_chunk=1024, loss=loss)
    trainers = {s: RLTrainer(clone_model(model), cfg, vocab=VOCAB) for s in SIDES}
    if not args.tail:
        lengths = f"{args.train_len} tokens"
    medians = step_case(f"SmolLM2-135M GRPO step (2 groups x 4 of {lengths})",
                        trainers, groups, args.repeats)  # fmt: skip
    # model FLOPs: 6 x parameters x the tokens computed (a group's prompt once)
    prompt = [sum(1 for m in g[0].loss_mask if not m) for g in groups]
    tokens = sum(p + sum(len(s.tokens) - p for s in g) for p, g in zip(prompt, groups, strict=True))
    flops = 6 * sum(p.numel() for p in model.parameters()) * tokens
    peak = gemm_peak(1)
    print(f"  {tokens} tokens; one-thread fp32 GEMM peak {peak / 1e9:.0f} GFLOP/s; MFU "
          + ", ".join(f"{s} {flops / medians[s] / peak:.1%}" for s in SIDES))  # fmt: skip


def engine_case(args: argparse.Namespace) -> None:
    from kv_reads import play, smollm2_engines

    from tandem.orchestrator.runtime.threads import torch_threads

    shape = argparse.Namespace(model=args.model, new_tokens=8)
    sets, _, engine = smollm2_engines(shape, 32)
    eng = engine()
    with torch_threads(2):
        play(eng, sets["warmup"], 2)
        _, plays = interleaved(
            dict.fromkeys(SIDES, partial(play, eng, sets["run32"], shape.new_tokens)),
            args.repeats,
        )
    times = {s: {"prefill": [p[0] for p in plays[s]], "decode": [p[1] for p in plays[s]]}
             for s in SIDES}  # fmt: skip
    turns = {s: plays[s][-1][2] for s in SIDES}
    equal = turns["16-row"] == turns["today"]
    print(f"\nSmolLM2-135M embedded engine, 32 prompts, two threads, median of {args.repeats}; "
          f"16-row and today's tokens and log-probs equal: {equal}")  # fmt: skip
    report(times, ("prefill", "decode"), {"prefill": "prefill s", "decode": "decode s/step"})
    if not equal:
        raise SystemExit("16-row and today's turns differ")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="", help="a demo policy dir (default: fresh weights)")
    ap.add_argument("--model", default=None, help="an imported SmolLM2 directory")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--sample-tokens", type=int, default=265)
    ap.add_argument("--smollm2", action="store_true", help="also SmolLM2-135M's GRPO step")
    ap.add_argument("--train-len", type=int, default=1000)
    ap.add_argument("--tail", type=int, default=0, help="sampled tokens after a tool prompt")
    ap.add_argument("--skip-demo", action="store_true")
    args = ap.parse_args()
    print(machine(1))
    products_case(args)
    if not args.skip_demo:
        demo_case(args)
    if args.smollm2:
        engine_case(args)
        smollm2_case(args)
    agreed = sum(gemm._agreement.values())
    print(f"\nlong tiles had the bits of 16-row tiles for {agreed} of the "
          f"{len(gemm._agreement)} weight layouts checked")  # fmt: skip


if __name__ == "__main__":
    main()
