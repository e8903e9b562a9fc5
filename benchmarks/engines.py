"""The same GRPO groups on the embedded engine and on a vLLM server, side by side.

Both engines play the same tasks (real episodes in the sandbox, the demo's task family and
episode settings) from the same checkpoint, every group at once; then each applies the same
published delta (a perturbed copy of the policy, about 3% of its elements changed) in its
pause. The trainer's forward (under `batch_invariant()`, as RL runs it) scores every
sample each engine produced: the embedded engine's log-probs are the trainer's bit for bit,
vLLM's differ by its own numerics. Printed per engine: trajectories/s, sampled tokens/s,
update pause, and max/mean |Δ log-prob| against the trainer; then vLLM over embedded.

The vLLM server's start (tens of seconds on two cores; creating its environment the first
time comes before) is reported apart and not counted. The default policy is the demo's
model shape, randomly initialised, with head_dim 32 (vLLM's CPU attention has no smaller
head size); ``--policy DIR`` takes a mid-trained one (e.g. ``runs/demo/midtrained`` of a
demo run with ``--set model.head_dim=32``).

With ``--gpu`` (run by scripts/gpu_check.sh on a CUDA machine) the embedded engine and the
trainer's scoring run on the GPU, and the vLLM server there reports every token's experts
and runs batch-invariant (tandem starts it so on CUDA): vLLM's samples are scored under R3
replay, and the routing agreement of the trainer's free routing with them is printed.

    uv run python benchmarks/engines.py [--groups 8] [--group-size 8] [--policy DIR] [--gpu]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import msgspec
import torch
from weight_update import publish_update

from tandem.app.config import load_config
from tandem.app.pipeline_config import PipelineConfig
from tandem.delta_sync import LocalStore, Subscriber
from tandem.moe_determinism import MoETransformer, batch_invariant, routing_agreement
from tandem.moe_determinism.model.hf import hf_layout, save_hf
from tandem.orchestrator import build_model, load_policy
from tandem.orchestrator.inference.embedded.engine import InferenceEngine
from tandem.orchestrator.inference.embedded.server import EngineServer
from tandem.orchestrator.inference.formats import chat_format_for
from tandem.orchestrator.inference.tokenizer import ByteTokenizer
from tandem.orchestrator.inference.vllm.engine import VllmEngine
from tandem.orchestrator.inference.vllm.serving import vllm_servers
from tandem.orchestrator.inference.vllm.weights import VllmWeights
from tandem.orchestrator.policy import clone_model
from tandem.orchestrator.rollout.group import play_group
from tandem.orchestrator.rollout.tasks import TaskSource
from tandem.orchestrator.training.collate import collate
from tandem.orchestrator.training.scoring import routes_known, score
from tandem.orchestrator.wire import Sample


def logprob_gap(
    model: MoETransformer, samples: list[Sample], vocab: int
) -> tuple[float, float, float]:
    """max and mean |engine log-prob - trainer log-prob| over the sampled tokens, scored
    under R3 replay where the engine reported its experts; and the agreement of the
    trainer's free routing with those experts (NaN where there are none)."""
    device = next(model.parameters()).device
    batch = collate([samples]).to(device)
    known = routes_known(batch)
    with torch.no_grad(), batch_invariant():
        trainer, _, _ = score(model, batch, "R3" if known else "none", 1.0, vocab)
        _, free_ids, counts = score(model, batch, "none", 1.0, vocab)
    gap = (trainer - batch.rollout_logprobs).abs()[batch.loss_mask]
    agreement = float("nan")
    if known:
        routes = batch.extras["routes"]
        recorded = torch.cat([routes[i, :n].long() for i, n in enumerate(counts)])
        agreement = routing_agreement(free_ids, recorded).per_decision
    return float(gap.max()), float(gap.mean()), agreement


async def play_all(engine, chat, config, tasks: TaskSource, groups: int, size: int):
    t0 = time.perf_counter()
    played = await asyncio.gather(
        *(
            play_group(
                engine,
                chat,
                tasks[i],
                env=config.env,
                episode=config.episode,
                engine_cfg=config.engine,
                seed=config.run.seed,
                index=i,
                group_size=size,
            )
            for i in range(groups)
        )
    )
    wall = time.perf_counter() - t0
    return [s for g in played for s in g.samples], wall


def embedded_side(model, chat, config, tasks, args, store) -> dict[str, float]:
    engine = InferenceEngine(
        clone_model(model).to(args.device),
        config.engine,
        stop_id=chat.end_id,
        vocab=chat.tok.vocab_size,
    )

    async def go():
        server = EngineServer(engine)
        serving = asyncio.create_task(server.serve())
        samples, wall = await play_all(server, chat, config, tasks, args.groups, args.group_size)
        await server.pull(Subscriber(LocalStore(store), version=0), 1)
        while engine.version < 1:
            await asyncio.sleep(0.002)
        server.close()
        await serving
        return samples, wall

    with batch_invariant(config.engine.deterministic):
        samples, wall = asyncio.run(go())
    return summary(
        clone_model(model).to(args.device),
        samples,
        wall,
        engine.stats.pause_seconds[-1],
        chat.tok.vocab_size,
    )


def vllm_side(model, chat, config, tasks, args, store, work: Path) -> dict[str, float]:
    mc = model.config
    t0 = time.perf_counter()
    with vllm_servers(
        save_hf(model, work / "policy"), mc, config.engine, log_dir=work, seed=config.run.seed
    ) as servers:
        start_s = time.perf_counter() - t0
        engine = VllmEngine.for_policy(servers.urls, config.engine, mc, chat)

        async def go():
            weights = VllmWeights(servers.urls[0])
            await weights.follow(str(store), 0, hf_layout(model))
            samples, wall = await play_all(
                engine, chat, config, tasks, args.groups, args.group_size
            )
            update = await weights.update(1)
            await weights.close()
            await engine.close()
            return samples, wall, update

        samples, wall, update = asyncio.run(go())
    out = summary(
        clone_model(model).to(args.device),
        samples,
        wall,
        update.pause_s if update else float("nan"),
        chat.tok.vocab_size,
    )
    out["start_s"] = start_s
    return out


def summary(
    model, samples: list[Sample], wall: float, pause: float, vocab: int
) -> dict[str, float]:
    sampled = sum(sum(s.loss_mask) for s in samples)
    worst, mean, agreement = logprob_gap(model, samples, vocab)
    return {
        "trajectories_per_s": len(samples) / wall,
        "tokens_per_s": sampled / wall,
        "wall_s": wall,
        "pause_s": pause,
        "gap_max": worst,
        "gap_mean": mean,
        "routing_agreement": agreement,
        "pass_rate": sum(s.reward for s in samples) / len(samples),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--policy", default="", help="a policy directory (head_dim vLLM serves)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("-c", "--config", default="configs/demo.toml")
    parser.add_argument(
        "--gpu",
        action="store_true",
        help="on a CUDA GPU: the embedded engine and scoring there, vLLM with routed experts",
    )
    args = parser.parse_args()
    if args.gpu and not torch.cuda.is_available():
        raise SystemExit("--gpu: no CUDA device visible to torch")
    args.device = "cuda" if args.gpu else "cpu"
    config = load_config(PipelineConfig, args.config, ["engine.kind=vllm", "model.head_dim=32"])
    torch.manual_seed(args.seed)
    if args.policy:
        model = load_policy(args.policy)
        config.model = msgspec.structs.replace(model.config, path="")
    else:
        model = build_model(config.model, ByteTokenizer())
    model.eval()
    chat = chat_format_for(model.config.path)
    tasks = TaskSource(config.tasks, config.tasks.train_seed)
    torch.set_num_threads(1)  # the embedded engine as RL runs it; vLLM sets its own
    with tempfile.TemporaryDirectory(prefix="tandem-engines-") as tmp:
        work = Path(tmp)
        store = work / "weights"
        publish_update(model, store, args.seed + 1)
        rows = {
            "embedded": embedded_side(model, chat, config, tasks, args, store),
            "vllm": vllm_side(model, chat, config, tasks, args, store, work),
        }
    n = args.groups * args.group_size
    print(
        f"\n{args.groups} groups x {args.group_size} ({n} trajectories), same tasks and checkpoint"
    )
    print(f"vLLM server start (not counted): {rows['vllm']['start_s']:.1f} s")
    head = f"{'':10} {'traj/s':>8} {'tokens/s':>9} {'wall s':>7} {'pause s':>8} {'max |Δlp|':>10} {'mean |Δlp|':>11} {'routing':>8} {'reward':>7}"
    print(head)
    for name, r in rows.items():
        print(
            f"{name:10} {r['trajectories_per_s']:8.2f} {r['tokens_per_s']:9.0f} {r['wall_s']:7.1f} "
            f"{r['pause_s']:8.3f} {r['gap_max']:10.2e} {r['gap_mean']:11.2e} "
            f"{r['routing_agreement']:8.4f} {r['pass_rate']:7.3f}"
        )
    e, v = rows["embedded"], rows["vllm"]
    print(
        f"vLLM / embedded: trajectories/s {v['trajectories_per_s'] / e['trajectories_per_s']:.2f}x, "
        f"tokens/s {v['tokens_per_s'] / e['tokens_per_s']:.2f}x, pause {v['pause_s'] / e['pause_s']:.1f}x"
    )


if __name__ == "__main__":
    main()
