"""The split attention's backward given its forward's output and log-sum-exp, against the
backward that ran torch's fused forward again to get them, in one process.

The CPU split attention's gradient comes from torch's fused attention backward
(`ops/attention_grad.py`), which needs the forward's output and each query's log-sum-exp.
Before, the backward ran torch's fused forward once more to get them; today the split
attention's own forward hands them over. The baseline (kept here) drops them, so the
backward recomputes them as before.

The demo's GRPO step (its config, groups shaped like its rollouts, one thread, as
benchmarks/expert_products.py) and, with ``--smollm2``, a GRPO step of SmolLM2-135M-Instruct
(2 groups of 4 samples of ``--train-len`` tokens, one thread), both sides interleaved. The
weights differ between the sides only by float rounding of the gradients: the script prints
the largest difference after the last step.

    uv run python benchmarks/attention_backward.py [--policy runs/demo/midtrained] [--smollm2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from kv_reads import report
from smollm2 import VOCAB, default_model, machine, trainer_groups

from tandem.moe_determinism.ops import attention_grad

TODAY = attention_grad.fused_attention_grad


def recomputed(*args: Any, forward: Any = None) -> Any:
    """The baseline: the forward's output and log-sum-exp dropped, so torch's fused forward
    runs again in the backward to get them."""
    return TODAY(*args)


SIDES = {"recomputed": recomputed, "today": TODAY}


def steps(name: str, trainers: dict[str, Any], groups: list, repeats: int) -> None:
    from tandem.orchestrator.runtime.threads import torch_threads

    times: dict[str, dict[str, list[float]]] = {s: {"step": []} for s in SIDES}
    with torch_threads(1):
        for r in range(2 * repeats + 1):
            for side in list(SIDES) if r % 2 else list(SIDES)[::-1]:
                attention_grad.fused_attention_grad = SIDES[side]
                try:
                    t0 = time.perf_counter()
                    trainers[side].step(groups, version=r)
                    if r:  # the first is a warm-up
                        times[side]["step"].append(time.perf_counter() - t0)
                finally:
                    attention_grad.fused_attention_grad = TODAY
    a, b = ({n: t.detach() for n, t in trainers[s].model.named_parameters()} for s in SIDES)
    diff = max(float((a[n] - b[n]).abs().max()) for n in a)
    scale = max(float(a[n].abs().max()) for n in a)
    print(f"\n{name}, one thread, median of {2 * repeats}; largest weight difference after "
          f"{2 * repeats + 1} steps: {diff:.2e} (largest weight {scale:.2f})")  # fmt: skip
    report(times, ("step",), {"step": "step s"})
    print(f"  median {statistics.median(times['recomputed']['step']):.3f} s before, "
          f"{statistics.median(times['today']['step']):.3f} s today")  # fmt: skip


def demo_case(args: argparse.Namespace) -> None:
    from expert_products import demo_step_inputs

    from tandem.orchestrator.policy import clone_model
    from tandem.orchestrator.training.trainer import RLTrainer

    cfg, model, groups, trainer_cfg = demo_step_inputs(args.policy, args.sample_tokens)
    trainers = {s: RLTrainer(clone_model(model), trainer_cfg, temperature=1.0) for s in SIDES}
    name = (f"the demo's GRPO step ({cfg.rl.groups_per_step} groups x {cfg.rl.group_size}, "
            f"{args.sample_tokens} tokens per sample after a 650-token prompt)")  # fmt: skip
    steps(name, trainers, groups, args.repeats)


def smollm2_case(args: argparse.Namespace) -> None:
    from tandem.orchestrator.config import TrainerConfig
    from tandem.orchestrator.policy import clone_model, load_policy
    from tandem.orchestrator.training.trainer import RLTrainer

    model_dir = Path(args.model) if args.model else default_model()
    model = load_policy(model_dir)
    groups = trainer_groups(model, model_dir, argparse.Namespace(group_size=4,
                                                                  train_len=args.train_len))  # fmt: skip
    cfg = TrainerConfig(lr=1e-6, routing_check_rows=0, logits_chunk=1024)
    trainers = {s: RLTrainer(clone_model(model), cfg, vocab=VOCAB) for s in SIDES}
    steps(f"SmolLM2-135M GRPO step (2 groups x 4 of {args.train_len} tokens)", trainers, groups,
          args.repeats)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="", help="a demo policy dir (default: fresh weights)")
    ap.add_argument("--sample-tokens", type=int, default=265)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--smollm2", action="store_true", help="also SmolLM2-135M's step")
    ap.add_argument("--model", default=None, help="an imported SmolLM2 directory")
    ap.add_argument("--train-len", type=int, default=600)
    args = ap.parse_args()
    print(machine(torch.get_num_threads()))
    demo_case(args)
    if args.smollm2:
        smollm2_case(args)


if __name__ == "__main__":
    main()
