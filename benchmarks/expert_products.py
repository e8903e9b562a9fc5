"""Routed expert products without padding, against the padded batch they replaced.

The padded products (kept here as the baseline) stack every expert's rows into one
[experts, busiest expert's rows, hidden] batch for `torch.bmm`, so each expert pays for the
busiest one. `model.experts.routed_experts` multiplies each expert's own rows. Both run in
this process, interleaved, from the same weights and routes:

1. one MoE layer, forward and backward, with torch's kernels and under
   `batch_invariant()`, at the demo's shape and at a wider one, with a router skewed as a
   trained one is (`--skew`: the busiest expert's share of the rows);
2. the demo's GRPO step (`RLTrainer.step`, its config, groups shaped like its rollouts as
   in benchmarks/prefix_scoring.py) as before (padded experts, and the split attention's
   own autograd graph), with unpadded experts, and today (unpadded experts, attention's
   gradient from torch's fused kernel: `ops/attention_grad.py`).

Printed: the padding factor (the padded rows over the routed rows), median milliseconds of
each side and their ratio (padded over unpadded), and for the step each side's median and
speed-up over before, and how far apart the weights end (the forward bits are equal; the
gradients differ in rounding).

    uv run python benchmarks/expert_products.py [--policy runs/demo/midtrained] [--repeats 5]
        [--sample-tokens 110]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import msgspec
import torch
import torch.nn.functional as F

from tandem.moe_determinism import batch_invariant, is_batch_invariant
from tandem.moe_determinism.model import experts as experts_module
from tandem.moe_determinism.model import layers
from tandem.moe_determinism.ops.tiles import ROW_TILE


def padded_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    gate_proj: torch.Tensor,
    up_proj: torch.Tensor,
    down_proj: torch.Tensor,
) -> torch.Tensor:
    """The baseline: every expert's rows in one zero-padded [experts, busiest, hidden] batch."""
    tokens, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_proj.shape[0])
    starts = torch.cumsum(counts, 0) - counts
    expert_of = flat[order]
    rank = torch.arange(flat.numel(), device=x.device) - starts[expert_of]
    cap = int(counts.max()) if flat.numel() else 0
    if is_batch_invariant() and not x.is_cuda:
        cap = -(-cap // ROW_TILE) * ROW_TILE
    xe = x.new_zeros(gate_proj.shape[0], cap, x.shape[-1])
    xe[expert_of, rank] = x[order // k]
    hidden = F.silu(torch.bmm(xe, gate_proj.transpose(1, 2))) * torch.bmm(
        xe, up_proj.transpose(1, 2)
    )
    ye = torch.bmm(hidden, down_proj.transpose(1, 2))
    slots = x.new_zeros(flat.numel(), x.shape[-1])
    slots[order] = ye[expert_of, rank]
    return slots.view(tokens, k, -1)


def skewed_routes(tokens: int, experts: int, k: int, skew: float, seed: int) -> torch.Tensor:
    """Ascending top-k ids per token with expert 0 in about ``skew`` of the tokens."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=gen)
    scores[:, 0] += (torch.rand(tokens, generator=gen) < skew).float()
    return scores.topk(k, dim=-1).indices.sort(-1).values


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def layer_case(name: str, shape: tuple[int, int, int, int, int], args: argparse.Namespace) -> None:
    tokens, hidden, ffn, experts, k = shape
    gen = torch.Generator().manual_seed(0)
    weights = [
        (torch.randn(experts, ffn, hidden, generator=gen) * 0.05).requires_grad_(),
        (torch.randn(experts, ffn, hidden, generator=gen) * 0.05).requires_grad_(),
        (torch.randn(experts, hidden, ffn, generator=gen) * 0.05).requires_grad_(),
    ]
    x = torch.randn(tokens, hidden, generator=gen).requires_grad_()
    ids = skewed_routes(tokens, experts, k, args.skew, 1)
    counts = torch.bincount(ids.reshape(-1), minlength=experts)
    padding = float(counts.max() * experts / counts.sum())
    for invariant in (False, True):
        times: dict[str, list[float]] = {"padded": [], "unpadded": []}
        sides = {"padded": padded_experts, "unpadded": experts_module.routed_experts}

        def run(fn: Callable[..., torch.Tensor], invariant: bool = invariant) -> None:
            with batch_invariant(invariant):
                out = fn(x, ids, *weights)
                out.sum().backward()

        for r in range(args.repeats + 1):
            for side in ("padded", "unpadded") if r % 2 else ("unpadded", "padded"):
                t = timed(partial(run, sides[side]))
                if r:  # the first round warms both up
                    times[side].append(t)
        p, u = (statistics.median(times[s]) * 1e3 for s in ("padded", "unpadded"))
        path = "batch_invariant" if invariant else "torch kernels"
        print(
            f"{name:>6} {tokens}x{hidden} ffn {ffn} {experts}e top-{k} {path:>15}: "
            f"padding {padding:.2f}x, padded {p:8.1f} ms, unpadded {u:8.1f} ms, {p / u:.2f}x"
        )


def demo_step_inputs(policy: str, sample_tokens: int) -> tuple[Any, Any, list, Any]:
    """The demo's config, its policy (the ``policy`` directory, else fresh weights), 4 groups
    of 8 shaped like its rollouts (a 650-token shared prompt, ``sample_tokens`` each after
    it: benchmarks/prefix_scoring.py) and its trainer config without the routing check."""
    from prefix_scoring import make_groups

    from tandem.app.config import load_config
    from tandem.app.pipeline_config import PipelineConfig
    from tandem.orchestrator.inference.chat_format import ChatFormat
    from tandem.orchestrator.policy import build_model, load_policy

    cfg = load_config(PipelineConfig, "configs/demo.toml", [])
    model = (
        load_policy(policy)
        if policy
        else build_model(cfg.model, ChatFormat().tok, seed=cfg.midtrain.init_seed)
    )
    shape = argparse.Namespace(groups=4, group_size=8, prefix=650, suffix=sample_tokens)
    groups = make_groups(model, shape, torch.Generator().manual_seed(0))
    return cfg, model, groups, msgspec.structs.replace(cfg.trainer, routing_check_rows=0)


def demo_step(args: argparse.Namespace) -> None:
    """The demo's GRPO step three ways, interleaved: as before (padded experts, the split
    attention's own autograd graph), with unpadded experts, and with unpadded experts and
    the fused attention gradient (today's code)."""
    from tandem.moe_determinism.ops import split_attention
    from tandem.orchestrator.policy import clone_model
    from tandem.orchestrator.training.trainer import RLTrainer

    cfg, model, groups, trainer_cfg = demo_step_inputs(args.policy, args.sample_tokens)
    fused = split_attention.needs_graph

    def graph_attention(*_: torch.Tensor) -> bool:
        return False  # the split attention records its own graph, as before

    sides = {  # experts, whether attention takes the fused kernel's gradient
        "before": (padded_experts, graph_attention),
        "unpadded experts": (experts_module.routed_experts, graph_attention),
        "today": (experts_module.routed_experts, fused),
    }
    trainers = {s: RLTrainer(clone_model(model), trainer_cfg, temperature=1.0) for s in sides}
    times: dict[str, list[float]] = {s: [] for s in sides}
    names = list(sides)
    for r in range(args.repeats + 1):
        for side in names if r % 2 else names[::-1]:
            layers.routed_experts, split_attention.needs_graph = sides[side]
            t = timed(partial(trainers[side].step, groups, version=r))
            if r:
                times[side].append(t)
    layers.routed_experts, split_attention.needs_graph = experts_module.routed_experts, fused
    base = statistics.median(times["before"])
    print(f"demo GRPO step ({cfg.rl.groups_per_step} groups x {cfg.rl.group_size}, "
          f"{cfg.trainer.updates_per_step} updates, {args.sample_tokens} tokens per sample "
          f"after the shared prompt), median of {args.repeats}:")  # fmt: skip
    for side in names:
        m = statistics.median(times[side])
        print(f"  {side:>17}: {m:.3f} s, {base / m:.2f}x")
    a, b = (dict(trainers[s].model.named_parameters()) for s in ("before", "today"))
    worst = max(float((a[n] - b[n]).detach().abs().max()) for n in a)
    print(
        f"  after {args.repeats + 1} steps each, max |weight difference| before/today {worst:.3g}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="", help="demo policy dir (default: fresh weights)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skew", type=float, default=0.35)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-step", action="store_true")
    parser.add_argument(
        "--sample-tokens",
        type=int,
        default=110,
        help="tokens of each sample after its group's shared prompt (the demo's RL: about 265)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.threads} thread(s), busiest expert in ~{args.skew:.0%} of the tokens")
    layer_case("demo", (6144, 96, 144, 4, 2), args)
    layer_case("wide", (2048, 256, 512, 32, 4), args)
    if not args.skip_step:
        demo_step(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
