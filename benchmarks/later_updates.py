"""The demo's GRPO step with its second update on torch's own kernels, against the step whose
every update runs the batch-invariant ones, in one process.

Only a step's first pass is compared with the engine (its log-probs are the rollouts' bits
on the same version); the second update scores weights no engine ever sampled from, so
`RLTrainer` runs it under `stock_kernels()` unless ``trainer.exact_later_updates``. Both
sides take the demo's config (two updates per step), its policy (``--policy``, else fresh
weights) and 4 groups of 8 shaped like its rollouts (a 650-token shared prompt,
``--sample-tokens`` each after it), one thread, interleaved from the same weights. Printed:
the machine, median step seconds each way and the ratio, the first step's mismatch with the
rollouts' log-probs (the groups' own version: 0 both ways) and how far apart the weights
end.

    uv run python benchmarks/later_updates.py [--policy runs/demo/midtrained] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import msgspec
from expert_products import demo_step_inputs
from kv_reads import report
from smollm2 import machine

from tandem.orchestrator.policy import clone_model
from tandem.orchestrator.runtime.threads import torch_threads
from tandem.orchestrator.training.trainer import RLTrainer

SIDES = {"exact": True, "today": False}  # side -> exact_later_updates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="", help="demo policy dir (default: fresh weights)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sample-tokens", type=int, default=265)
    args = ap.parse_args()
    cfg, model, groups, trainer_cfg = demo_step_inputs(args.policy, args.sample_tokens)
    trainers = {
        side: RLTrainer(
            clone_model(model),
            msgspec.structs.replace(trainer_cfg, exact_later_updates=exact),
            temperature=1.0,
        )
        for side, exact in SIDES.items()
    }
    times: dict[str, dict[str, list[float]]] = {s: {"step": []} for s in SIDES}
    mismatch: dict[str, float] = {}
    with torch_threads(1):
        for r in range(2 * args.repeats + 1):
            for side in list(SIDES) if r % 2 else list(SIDES)[::-1]:
                t0 = time.perf_counter()
                metrics = trainers[side].step(groups, version=r)
                if r:  # the first is a warm-up
                    times[side]["step"].append(time.perf_counter() - t0)
                if "mismatch_max_abs" in metrics:  # the groups' own version: the first step
                    mismatch[side] = metrics["mismatch_max_abs"]
    print(machine(1))
    print(f"demo GRPO step ({cfg.rl.groups_per_step} groups x {cfg.rl.group_size}, "
          f"{trainer_cfg.updates_per_step} updates, {args.sample_tokens} tokens per sample "
          f"after a 650-token prompt), median of {2 * args.repeats}:")  # fmt: skip
    report(times, ("step",), {"step": "step s"})
    exact, today = (statistics.median(times[s]["step"]) for s in SIDES)
    a, b = (dict(trainers[s].model.named_parameters()) for s in SIDES)
    apart = max(float((a[n] - b[n]).detach().abs().max()) for n in a)
    print(f"  exact / today: {exact / today:.2f}x; first step's mismatch max |d| "
          f"{mismatch['exact']:g} / {mismatch['today']:g}; weights apart by at most "
          f"{apart:.3g} after {2 * args.repeats + 1} steps")  # fmt: skip


if __name__ == "__main__":
    main()
