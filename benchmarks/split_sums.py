"""The split attention's sum over KV splits: the dense grid before, per prefix length today.

The CPU split attention reduces each query block's per-split partial sums by one fixed tree
over all the block's KV splits. Before, it placed the computed pairs in a zero-filled dense
[blocks, splits, rows, dim] grid and summed that whole grid: a causal prefill's grid is half
zeros, filled and summed again for every pass. Today `ops.split_grid.prefix_tree_sum` sums
each block's own splits (a prefix of them), blocks of one prefix length together, with the
dense tree's bits (the baseline is kept here).

Two cases, both sides interleaved in one process, their outputs required equal:

1. attention alone: one layer's split attention over a batch of 8 sequences of 1,100 tokens
   (9 query heads, 3 KV heads, head dim 64: SmolLM2-135M's attention), no autograd graph
   (the engine's prefill, the trainer's forward);
2. the embedded engine's prefill of 32 chat-rendered task prompts on SmolLM2-135M-Instruct
   (imported as benchmarks/smollm2.py does; the system message cached by a warm-up turn).

    uv run python benchmarks/split_sums.py [--model DIR] [--repeats 2]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch
from kv_reads import play, report, smollm2_engines
from smollm2 import embedded_run, machine

from tandem.moe_determinism.ops import split_attention, split_grid
from tandem.moe_determinism.ops.reduction import tree_sum

TODAY = split_grid.prefix_tree_sum


def dense_grid(
    values: torch.Tensor, pair: torch.Tensor, block_of: torch.Tensor, blocks: int, n_sp: int
) -> torch.Tensor:
    """The baseline: the zero-filled [blocks, splits, ...] grid, summed whole."""
    grid = values.new_zeros(blocks * n_sp, *values.shape[1:])
    grid.index_copy_(0, pair, values)
    return tree_sum(grid.view(blocks, n_sp, *values.shape[1:]), dim=1)


SIDES = {"dense grid": dense_grid, "today": TODAY}


def interleaved(repeats: int, run: dict[str, Callable[[], object]]) -> dict[str, list]:
    """Each side ``repeats`` times, alternating which goes first; results per side."""
    out: dict[str, list] = {s: [] for s in SIDES}
    names = list(SIDES)
    for r in range(repeats):
        for side in names if r % 2 else names[::-1]:
            split_grid.prefix_tree_sum = SIDES[side]
            try:
                out[side].append(run[side]())
            finally:
                split_grid.prefix_tree_sum = TODAY
    return out


def attention_case(args: argparse.Namespace) -> None:
    gen = torch.Generator().manual_seed(0)
    b, hq, hkv, t, d = 8, 9, 3, 1100, 64
    q = torch.randn(b, hq, t, d, generator=gen)
    k, v = (torch.randn(b, hkv, t, d, generator=gen) for _ in range(2))

    def once() -> tuple[float, torch.Tensor]:
        with torch.no_grad():
            t0 = time.perf_counter()
            out = split_attention.attention(q, k, v)
            return time.perf_counter() - t0, out

    results = interleaved(2 * args.repeats + 1, {s: once for s in SIDES})
    equal = torch.equal(results["dense grid"][-1][1], results["today"][-1][1])
    times = {s: {"forward": [r[0] for r in results[s][1:]]} for s in SIDES}  # first: warm-up
    print(f"\nsplit attention, one layer: {b} x {t} tokens, {hq} query / {hkv} KV heads, "
          f"dim {d}, no graph; median of {2 * args.repeats}; outputs equal: {equal}")  # fmt: skip
    report(times, ("forward",), {"forward": "forward s"})
    if not equal:
        raise SystemExit("the sides' outputs differ")


def engine_case(args: argparse.Namespace) -> None:
    c = 32
    sets, _, engine = smollm2_engines(args, c)
    engines = {s: engine() for s in SIDES}
    for eng in engines.values():
        embedded_run(eng, sets["warmup"], 2, seed=0)

    results = interleaved(
        args.repeats,
        {s: partial(play, engines[s], sets[f"run{c}"], args.new_tokens) for s in SIDES},
    )
    same = results["dense grid"][-1][2] == results["today"][-1][2]
    times = {s: {"prefill": [r[0] for r in results[s]]} for s in SIDES}
    print(f"\nembedded engine, SmolLM2-135M, prefill of {c} prompts (mean "
          f"{sum(map(len, sets[f'run{c}'])) / c:.0f} tokens); median of {args.repeats}; "
          f"same tokens and log-probs on both sides: {same}")  # fmt: skip
    report(times, ("prefill",), {"prefill": "prefill s"})
    if not same:
        raise SystemExit("the sides' turns differ")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="an imported SmolLM2 directory")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=2)
    ap.add_argument("--skip-engine", action="store_true")
    args = ap.parse_args()
    print(machine(torch.get_num_threads()))
    attention_case(args)
    if not args.skip_engine:
        engine_case(args)


if __name__ == "__main__":
    main()
