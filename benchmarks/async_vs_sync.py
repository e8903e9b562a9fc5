"""Asynchronous, pipelined and synchronous GRPO: the same config for the same wall time.

All three modes start from the same policy and play real episodes (a sandbox per episode,
hidden tests run in the sandbox to grade every episode). Printed per mode: trajectories/s,
trainer idle fraction (time the trainer waits for data / its total time), engine busy
fraction (time the engine spends in prefill and decode steps / its time up), steps, stale
drops, and the held-out pass@1 reached; then the pipelined/sync and async/sync ratios
(pipelined: rollouts of the next step overlap training in lock step, staleness 1).

Placement (``--placement``): ``split`` (default) runs the engine and the trainer as two Ray
actors with one torch thread each, as inference and training hardware are apart in a
cluster: in sync mode each side idles while the other works. On one machine they still share
its cores, so the trainer runs at a lower CPU priority than the engine
(``rl.ray.trainer_nice``): in async mode the engine, which sets the pace, gets the CPU first
and the trainer the rest. ``shared`` runs both in this process, their threads sharing every
core. Under the table, sync's own split of its time gives what overlapping its two phases
alone would give, (rollout + train) / max(rollout, train), at sync's rollout speed: async's
engine also keeps more episodes in flight (larger batches and no end-of-step tail), while
both sides share this machine's cores and sandboxes.

``--rounds N`` runs the modes in turn N times, each run from the same policy, so that a
machine whose speed drifts slows every mode alike; the table gives the totals and the mean
held-out pass@1, and a line each round's ratio.

Every mode's policy is scored on the same held-out tasks, so the last lines compare them task
by task: each mode's pass@1 minus sync's, a task's rounds averaged, with a 95% interval over
the tasks (`paired_difference`). Two separate means of a few hundred episodes each differ
by a point or two from sampling alone; the paired difference says whether a gap is more.

By default it runs the comparison the target is about: sync and async, 300 s each, two
rounds, every policy scored on 192 held-out tasks x 4 (about half an hour on two cores).
Async, whose groups were played one or two versions back, needs about twice sync's steps to
reach the level where both modes flatten out (sync by about its 8th step, async by its 16th,
in the checkpoint curves the README quotes): 180 s gets only sync there, 300 s both.

    uv run python benchmarks/async_vs_sync.py                       # policy: runs/demo/midtrained
    uv run python benchmarks/async_vs_sync.py --modes sync,pipelined,async --rounds 1
    uv run python benchmarks/async_vs_sync.py --seconds 180 --eval-tasks 96 --max-staleness 1
    uv run python benchmarks/async_vs_sync.py --set trainer.updates_per_step=3
    uv run python benchmarks/async_vs_sync.py --policy none --synthetic-reward   # no policy needed

Target: async >= 1.8x the trajectories/s of sync at max_staleness <= 2, with no
lower final reward.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

SPLIT_PLACEMENT = [
    "rl.backend=ray",
    "rl.ray.workers=1",
    "rl.ray.torch_threads=1",
    "rl.ray.trainer_nice=19",
]
"""One engine actor and one trainer actor (one torch thread each), the trainer at a lower
CPU priority than the engine: on separate machines neither takes CPU from the other."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", default="configs/demo.toml", help="pipeline TOML config")
    parser.add_argument("--policy", default="runs/demo/midtrained", help="policy dir, or 'none'")
    parser.add_argument("--seconds", type=float, default=300.0, help="wall time per mode")
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="run the modes in turn this many times and report the totals",
    )
    parser.add_argument(
        "--placement",
        choices=("split", "shared"),
        default="split",
        help="split: engine and trainer as two single-thread Ray actors; shared: one process",
    )
    parser.add_argument("--eval-tasks", type=int, default=192)
    parser.add_argument("--eval-samples", type=int, default=4, help="samples per held-out task")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value by dotted key, as `tandem --set` (repeatable)",
    )
    parser.add_argument(
        "--modes",
        default="sync,async",
        help="comma-separated subset of sync,pipelined,async (ratios need sync)",
    )
    parser.add_argument(
        "--synthetic-reward",
        action="store_true",
        help="reward = parity of the generated tokens (wiring/throughput only, no learning)",
    )
    args = parser.parse_args()
    if args.rounds < 1:
        print(f"--rounds must be >= 1, got {args.rounds}", file=sys.stderr)
        return 2

    import torch

    from tandem.app.config import load_config
    from tandem.app.errors import ConfigError
    from tandem.app.logging import configure_logging
    from tandem.app.pipeline_config import PipelineConfig
    from tandem.orchestrator import (
        EvalResult,
        RunHooks,
        build_model,
        evaluate_policy,
        load_policy,
        reinforce,
        reuse_freed_memory,
    )
    from tandem.orchestrator.inference.tokenizer import ByteTokenizer
    from tandem.orchestrator.policy import clone_model

    configure_logging("warning", "console")
    reuse_freed_memory()  # as the `tandem` command does (the split placement's actors too)
    placement = SPLIT_PLACEMENT if args.placement == "split" else []
    try:
        cfg = load_config(PipelineConfig, args.config, [*placement, *args.overrides])
    except ConfigError as e:
        print(f"config: {e}", file=sys.stderr)
        return 2
    if args.policy == "none":
        if not args.synthetic_reward:
            print("a fresh policy never solves a task: add --synthetic-reward", file=sys.stderr)
            return 2
        base = build_model(cfg.model, ByteTokenizer(), seed=cfg.midtrain.init_seed)
    else:
        if not Path(args.policy).is_dir():
            print(
                f"{args.policy} not found: run `uv run tandem demo` (or `tandem midtrain`) first, "
                "or pass --policy none --synthetic-reward",
                file=sys.stderr,
            )
            return 2
        base = load_policy(args.policy)
    hooks = None
    if args.synthetic_reward:
        hooks = RunHooks(reward=lambda s: float(sum(s.tokens[-len(s.tokens) // 3 :]) % 2))

    modes = tuple(m for m in ("sync", "pipelined", "async") if m in args.modes.split(","))
    if not modes:
        print(f"--modes {args.modes!r} names none of sync, pipelined, async", file=sys.stderr)
        return 2
    # Rounds alternate the modes (sync, async, sync, async, ...), each from the same policy,
    # so a machine whose speed drifts during the benchmark slows every mode alike.
    results: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    evals: dict[str, list[EvalResult]] = {m: [] for m in modes}
    for _ in range(args.rounds):
        for mode in modes:
            rl = msgspec.structs.replace(
                cfg.rl,
                mode=mode,
                steps=100_000,
                max_staleness=args.max_staleness,
                checkpoint_every=100_000,
            )
            model = clone_model(base)
            run_dir = Path(tempfile.mkdtemp(prefix=f"tandem-bench-{mode}-"))
            # the run named after its directory, so each run's Ray actors have names of
            # their own
            run_cfg = msgspec.structs.replace(
                cfg, rl=rl, run=msgspec.structs.replace(cfg.run, name=run_dir.name)
            )
            t0 = time.perf_counter()
            summary = reinforce(
                model,
                run_cfg,
                run_dir=run_dir,
                task_offset=cfg.midtrain.transcripts,
                max_wall_s=args.seconds,
                hooks=hooks,
            )
            wall = time.perf_counter() - t0
            held = evaluate_policy(
                model,
                cfg,
                n_tasks=args.eval_tasks,
                samples=args.eval_samples,
            )
            shutil.rmtree(run_dir, ignore_errors=True)
            evals[mode].append(held)
            results[mode].append(
                {
                    "wall_s": wall,
                    "steps": summary.steps_done,
                    "trajectories": summary.trajectories,
                    "trainer_busy_s": summary.trainer_busy_s,
                    "trainer_wait_s": summary.trainer_wait_s,
                    "engine_busy_s": summary.engine_busy_s,
                    "engine_s": summary.engine_s,
                    "dropped": summary.dropped_stale,
                    "pass1": held.pass_at.get(1, 0.0),
                }
            )
            torch.manual_seed(0)
    print_table(args, cfg, {m: combine(r) for m, r in results.items()}, results)
    print_paired(evals)
    return 0


def combine(rounds: list[dict[str, float]]) -> dict[str, float]:
    """One mode's rounds as one run: counts and times add up, pass@1 is the rounds' mean."""

    def total(key: str) -> float:
        return sum(r[key] for r in rounds)

    trainer_s = total("trainer_busy_s") + total("trainer_wait_s")
    return {
        "wall_s": total("wall_s"),
        "steps": total("steps"),
        "trajectories": total("trajectories"),
        "traj_per_s": total("trajectories") / total("wall_s"),
        "idle": total("trainer_wait_s") / trainer_s if trainer_s > 0 else 0.0,
        "engine_busy": total("engine_busy_s") / total("engine_s") if total("engine_s") else 0.0,
        "dropped": total("dropped"),
        "pass1": total("pass1") / len(rounds),
    }


def print_table(
    args: argparse.Namespace,
    cfg: Any,
    results: dict[str, dict[str, float]],
    rounds: dict[str, list[dict[str, float]]],
) -> None:
    modes = list(results)
    s = results.get("sync")
    print()
    print(
        f"async and pipelined vs sync, {args.seconds:.0f} s each x {args.rounds} round(s), "
        f"async max_staleness {args.max_staleness}, {cfg.rl.groups_per_step} groups x "
        f"{cfg.rl.group_size} per step, {args.placement} placement"
    )
    if args.overrides:
        print("overrides: " + " ".join(args.overrides))
    ratio_modes = [m for m in ("pipelined", "async") if m in modes and s is not None]
    heads = [*modes, *(f"{m}/sync" for m in ratio_modes)]
    print(f"{'':28}" + "".join(f"{h:>16}" for h in heads))
    rows = [
        ("wall time (s)", "wall_s", ".0f"),
        ("RL steps", "steps", ".0f"),
        ("trajectories", "trajectories", ".0f"),
        ("trajectories / s", "traj_per_s", ".3f"),
        ("trainer idle fraction", "idle", ".2f"),
        ("engine busy fraction", "engine_busy", ".2f"),
        ("stale groups dropped", "dropped", ".0f"),
        (f"held-out pass@1 ({args.eval_tasks} tasks)", "pass1", ".3f"),
    ]
    for label, key, spec in rows:
        cells = [format(results[m][key], spec) for m in modes]
        ratios = [f"{results[m][key] / s[key]:.2f}" if s and s[key] else "nan" for m in ratio_modes]
        print(f"{label:28}" + "".join(f"{c:>16}" for c in [*cells, *ratios]))
    if s is None:
        return
    if args.rounds > 1:
        for m in ratio_modes:
            per_round = [
                f"{(a['trajectories'] / a['wall_s']) / (b['trajectories'] / b['wall_s']):.2f}"
                f" (pass@1 sync {b['pass1']:.3f}, {m} {a['pass1']:.3f})"
                for a, b in zip(rounds[m], rounds["sync"], strict=True)
            ]
            print(f"{m}/sync trajectories/s by round: " + ", ".join(per_round))
    # sync alternates: the trainer waits while rollouts play, and rollouts wait while it
    # trains; overlapping the two at the same speeds leaves only the longer phase
    longer = max(s["idle"], 1.0 - s["idle"])
    print(
        f"overlap alone (sync: rollouts {s['idle']:.0%} of its time, training "
        f"{1 - s['idle']:.0%}) would give {1 / longer:.2f}x"
    )


def print_paired(evals: dict[str, list[Any]]) -> None:
    """Each mode's held-out pass@1 minus sync's, task by task over the same held-out tasks
    (every round's result averaged per task), with a 95% interval over the tasks."""
    from tandem.orchestrator import paired_difference

    if "sync" not in evals or len(evals["sync"][0].solved) < 2:
        return
    for mode in ("pipelined", "async"):
        if mode in evals:
            d = paired_difference(evals[mode], evals["sync"])
            print(
                f"held-out pass@1, {mode} - sync, paired over {d.tasks} tasks: "
                f"{100 * d.mean:+.1f} points (95% interval {100 * d.low:+.1f} to "
                f"{100 * d.high:+.1f})"
            )


if __name__ == "__main__":
    sys.exit(main())
