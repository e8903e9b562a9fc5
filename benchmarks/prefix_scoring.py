"""The RL trainer's step with each group's shared prefix fed once, against every row whole.

Builds GRPO groups shaped like the demo's rollouts (a shared prompt, first call and file
observation of about 650 tokens, then each rollout's own edit of about 110), with routes and
log-probs recorded by the policy itself as the engine would record them, and times
`RLTrainer.step` both ways in one process, interleaved, from the same weights. Printed: the
tokens each way feeds, median step seconds, the ratio, and the train/rollout mismatch of both
(0: the shared scoring gives the engine's bits).

    uv run python benchmarks/prefix_scoring.py [--policy runs/demo/midtrained] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import msgspec
import numpy as np
import torch

from tandem.app.config import load_config
from tandem.app.pipeline_config import PipelineConfig
from tandem.moe_determinism import MoETransformer, batch_invariant
from tandem.orchestrator.inference.chat_format import ChatFormat
from tandem.orchestrator.policy import build_model, clone_model, load_policy
from tandem.orchestrator.training.collate import collate
from tandem.orchestrator.training.scoring import score
from tandem.orchestrator.training.trainer import RLTrainer
from tandem.orchestrator.wire import Sample


def make_groups(
    model: MoETransformer, args: argparse.Namespace, gen: torch.Generator
) -> list[list[Sample]]:
    """Random-token groups: one prefix per group, a tail per row (the tail is the loss); the
    routes and log-probs are the policy's own (one free pass), as the engine records them."""
    cfg = model.config
    groups = []
    for g in range(args.groups):
        prefix = torch.randint(0, 256, (args.prefix,), generator=gen)
        samples = []
        for i in range(args.group_size):
            n = int(torch.randint(args.suffix // 2, args.suffix * 3 // 2 + 1, (1,), generator=gen))
            tokens = torch.cat([prefix, torch.randint(0, cfg.vocab_size, (n,), generator=gen)])
            shape = (len(tokens) - 1, cfg.num_hidden_layers, cfg.num_experts_per_tok)
            sample = Sample(
                task_id=f"g{g}",
                tokens=tokens.tolist(),
                loss_mask=[0] * args.prefix + [1] * n,
                logprobs=[0.0] * len(tokens),
                versions=[0] * len(tokens),
                routes=np.zeros(shape, dtype=np.uint8),  # replaced below
                reward=float((g + i) % 2),
                resolved=bool((g + i) % 2),
                turns=2,
                termination="budget",
                min_version=0,
                max_version=0,
            )
            with torch.no_grad(), batch_invariant():
                lp, routes, _ = score(model, collate([[sample]]), "none")
            sample.logprobs, sample.routes = lp[0].tolist(), routes.numpy()
            samples.append(sample)
        groups.append(samples)
    return groups


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", default="configs/demo.toml")
    parser.add_argument("--policy", default="", help="policy dir (default: fresh weights)")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prefix", type=int, default=650)
    parser.add_argument("--suffix", type=int, default=110)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    cfg = load_config(PipelineConfig, args.config, [])
    model = (
        load_policy(args.policy)
        if args.policy
        else build_model(cfg.model, ChatFormat().tok, seed=cfg.midtrain.init_seed)
    )
    groups = make_groups(model, args, torch.Generator().manual_seed(0))
    times: dict[bool, list[float]] = {True: [], False: []}
    last: dict[bool, dict] = {}
    for r in range(args.repeats):
        for share in (True, False) if r % 2 == 0 else (False, True):
            # one update per step: the cost of scoring the batch, whatever the config says
            trainer_cfg = msgspec.structs.replace(
                cfg.trainer, share_prefixes=share, routing_check_rows=0, updates_per_step=1
            )
            trainer = RLTrainer(clone_model(model), trainer_cfg, temperature=1.0)
            t0 = time.perf_counter()
            last[share] = trainer.step(groups, version=0)  # a fresh trainer: version 0
            times[share].append(time.perf_counter() - t0)
    whole, part = statistics.median(times[False]), statistics.median(times[True])
    print(f"{args.groups} groups x {args.group_size}, one update per step")
    print(f"{'':>22} {'whole rows':>12} {'shared prefix':>14}")
    fed = [last[s]["trainer_tokens_fed"] for s in (False, True)]
    print(f"{'tokens fed':>22} {fed[0]:>12} {fed[1]:>14}")
    print(f"{'step s (median)':>22} {whole:>12.3f} {part:>14.3f}")
    mism = [last[s]["mismatch_max_abs"] for s in (False, True)]
    print(f"{'mismatch max |d|':>22} {mism[0]:>12.3g} {mism[1]:>14.3g}")
    print(f"speedup: {whole / part:.2f}x ({args.repeats} repeats each, interleaved)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
