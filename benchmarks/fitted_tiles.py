"""Decode steps' products in one tile of their own rows, against 16-row tiles, in one process.

A product of fewer than `gemm.LONG_ROW_TILE` rows (a decode step: one row per sequence)
was cut into 16-row tiles: one sequence multiplied 16 rows, 32 sequences read every weight
twice. Today it takes one tile of `gemm.fitted_rows` rows (4 or 8 for a few rows, else the
count rounded up to 16) where this machine's BLAS gives a row the bits of a 16-row tile
(`gemm.tiles_agree`, checked once per weight layout and height). The two sides here,
interleaved: "16-row" (`gemm.FITTED_TILES = False`) and "today" (fitted tiles); they must give
equal products, tokens and log-probs.

Cases, SmolLM2-135M-Instruct's shapes, two threads (the engine's):

* one layer's seven products at 1 to 100 rows, median of ``--repeats``;
* the embedded engine (the prompts and engine of benchmarks/kv_reads.py: coding tasks of
  about 960 tokens, the system message cached) at 1, 8 and 32 sequences: seconds per
  decode step, ``--new-tokens`` tokens each.

    uv run python benchmarks/fitted_tiles.py [--model DIR] [--repeats 4]
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial

import torch
from kv_reads import play, report, smollm2_engines
from long_tiles import interleaved
from smollm2 import machine

from tandem.moe_determinism.ops import gemm

SIDES = ("16-row", "today")
LAYER = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)]
"""SmolLM2-135M's layer products (K, N): q, k, v, o, gate, up, down."""


def use(side: str) -> None:
    gemm.FITTED_TILES = side == "today"


def layer_products(inputs: dict[int, torch.Tensor], weights: list[torch.Tensor]) -> list:
    return [gemm.mm_blocks(inputs[w.shape[1]], w.t()) for w in weights]


def products_case(args: argparse.Namespace) -> None:
    from tandem.orchestrator.runtime.threads import torch_threads

    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) for k, n in LAYER]
    print(f"\nSmolLM2-135M's layer products (7), two threads, median of {args.repeats}:")
    with torch_threads(2):
        for rows in (1, 4, 8, 17, 32, 64, 100):
            inputs = {k: torch.randn(rows, k, generator=gen) for k, _ in LAYER}
            layer = partial(layer_products, inputs, weights)
            times, outs = interleaved(dict.fromkeys(SIDES, layer), args.repeats, use)
            equal = all(
                torch.equal(a, b)
                for a, b in zip(outs["16-row"][-1], outs["today"][-1], strict=True)
            )
            med = {s: statistics.median(times[s]) for s in SIDES}
            print(f"  {rows:>3} rows: 16-row {med['16-row'] * 1e3:.2f} ms, today (fitted) "
                  f"{med['today'] * 1e3:.2f} ms ({med['16-row'] / med['today']:.2f}x); "
                  f"equal: {equal}")  # fmt: skip
            if not equal:
                raise SystemExit("16-row and today's products differ")


def engine_case(args: argparse.Namespace) -> None:
    from tandem.orchestrator.runtime.threads import torch_threads

    for c in (1, 8, 32):
        shape = argparse.Namespace(model=args.model, new_tokens=args.new_tokens)
        sets, _, engine = smollm2_engines(shape, c)
        eng = engine()
        with torch_threads(2):
            play(eng, sets["warmup"], 2)
            run = partial(play, eng, sets[f"run{c}"], args.new_tokens)
            _, plays = interleaved(dict.fromkeys(SIDES, run), args.repeats, use)
        times = {s: {"decode": [p[1] for p in plays[s]]} for s in SIDES}
        equal = plays["16-row"][-1][2] == plays["today"][-1][2]
        print(f"\nSmolLM2-135M embedded engine, {c} sequence(s), two threads, median of "
              f"{args.repeats}; tokens and log-probs equal: {equal}")  # fmt: skip
        report(times, ("decode",), {"decode": "decode s/step"})
        if not equal:
            raise SystemExit("16-row and today's turns differ")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="an imported SmolLM2 directory")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--skip-engine", action="store_true")
    args = ap.parse_args()
    print(machine(2))
    products_case(args)
    if not args.skip_engine:
        engine_case(args)
    heights = {key[-1] for key, ok in gemm._agreement.items() if ok}
    print(f"\n{sum(gemm._agreement.values())} of {len(gemm._agreement)} (weight layout, tile "
          f"height) pairs checked had 16-row bits; heights checked: {sorted(heights)}")  # fmt: skip


if __name__ == "__main__":
    main()
