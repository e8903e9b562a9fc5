"""The pipeline commands: `midtrain`, `train`, `eval` and `demo` (both stages, before/after).

torch and the orchestrator are imported inside the functions, so `tandem --help` and config
validation stay fast and a bad config fails before any model is built.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import structlog

from tandem.app.config import dump_config
from tandem.app.pipeline_config import PipelineConfig

log = structlog.get_logger("tandem")


def _load(config: PipelineConfig) -> Any:
    from tandem.orchestrator import PolicyError, load_policy

    try:
        return load_policy(config.policy_dir)
    except PolicyError as e:
        print(f"tandem: {e}", file=sys.stderr)
        return None


def run_midtrain(config: PipelineConfig, args: argparse.Namespace) -> int:
    from tandem.orchestrator import midtrain_policy

    config.run_dir.mkdir(parents=True, exist_ok=True)
    _, info = midtrain_policy(config)
    print(f"mid-trained policy saved to {config.run_dir / 'midtrained'} ({info['steps']} steps)")
    return 0


def run_eval(config: PipelineConfig, args: argparse.Namespace) -> int:
    from tandem.orchestrator import evaluate_policy

    model = _load(config)
    if model is None:
        return 2
    result = evaluate_policy(model, config)
    for k, v in sorted(result.pass_at.items()):
        print(f"pass@{k} = {v:.3f}  ({result.tasks} tasks of seed {config.tasks.eval_seed})")
    width = max((len(c) for c in result.by_category), default=0)
    for category, score in result.by_category.items():
        print(f"  {category:<{width}}  pass@1 = {score.pass_at_1:.3f}  ({score.tasks} tasks)")
    return 0


def run_train(config: PipelineConfig, args: argparse.Namespace) -> int:
    """RL from the run's policy; Ctrl-C or SIGTERM stops at a step with a checkpoint, and the
    same command again resumes from it."""
    from tandem.orchestrator import RunHooks, reinforce, save_policy

    model = _load(config)
    if model is None:
        return 2
    rl_dir = config.run_dir / "rl"
    stopped: list[tuple[int, int]] = []
    hooks = RunHooks(
        stop_signals=(signal.SIGINT, signal.SIGTERM),
        on_stop=lambda sig, steps: stopped.append((sig, steps)),
    )
    try:
        summary = reinforce(model, config, progress=sys.stderr.isatty(), hooks=hooks)
    except KeyboardInterrupt:  # while starting, or a second Ctrl-C: no checkpoint written now
        print(
            f"tandem train: interrupted; the same command resumes from the last checkpoint "
            f"in {rl_dir / 'checkpoints'}, if any",
            file=sys.stderr,
        )
        return 128 + signal.SIGINT
    if stopped:
        sig, steps = stopped[0]
        print(
            f"tandem train: stopped by {signal.Signals(sig).name} after {steps} steps; "
            f"checkpoint in {rl_dir / 'checkpoints'}; the same command resumes from it",
            file=sys.stderr,
        )
        return 128 + sig
    save_policy(model, config.run_dir / "rl_trained", stage="rl", steps=summary.steps_done)
    _train_report(config, rl_dir, summary)
    print(
        f"RL: {summary.steps_done} steps, policy version {summary.policy_version}, "
        f"{summary.trajectories} trajectories in {summary.wall_s:.0f} s; "
        f"metrics in {rl_dir / 'metrics.jsonl'}"
    )
    return 0


def _train_report(config: PipelineConfig, rl_dir: Path, summary: Any) -> None:
    """reward_curve.png and report.md next to the RL metrics."""
    from tandem.orchestrator import fmt, plot_rewards, write_report

    image = plot_rewards(rl_dir / "metrics.jsonl", rl_dir / "reward_curve.png")
    last = summary.last_metrics
    rows = [
        ("steps / policy version", f"{summary.steps_done} / {summary.policy_version}"),
        ("trajectories", str(summary.trajectories)),
        ("last reward / pass rate", f"{fmt(last.get('reward'))} / {fmt(last.get('pass_rate'))}"),
        ("trainer idle fraction", fmt(summary.trainer_idle_fraction, ".2f")),
        ("dropped stale groups", str(summary.dropped_stale)),
        ("staleness histogram", str(summary.staleness_histogram)),
        ("last mismatch max |Δ| (same version)", fmt(last.get("mismatch_max_abs"), ".3g")),
        ("last routing agreement without replay", fmt(last.get("routing_agreement_free"), ".4f")),
        ("wall time", f"{summary.wall_s:.0f} s"),
    ]
    write_report(
        rl_dir / "report.md",
        title=f"tandem RL run {config.run.name}",
        rows=rows,
        config_toml=dump_config(config),
        image=image.name,
    )


def run_demo(config: PipelineConfig, args: argparse.Namespace) -> int:
    """Mid-train, evaluate, RL, evaluate again: the amount of work is the config's; the wall
    time of each stage is reported, and ``[demo]``'s caps (off by default) may cut it."""
    import torch

    from tandem.app.demo_report import category_rows, demo_table, print_table, write_demo_report
    from tandem.orchestrator import (
        EvalBeside,
        check_rl_engine,
        evaluate_policy,
        midtrain_policy,
        reinforce,
        save_policy,
    )

    check_rl_engine(config)  # before minutes of mid-training
    if config.demo.compare.variants:
        from tandem.app.compare import run_compare

        config.run_dir.mkdir(parents=True, exist_ok=True)
        run_compare(config, config.demo.compare)
        return 0
    if config.engine.kind == "vllm":
        from tandem.orchestrator import servable_head_dim

        head_dim = servable_head_dim(config.model.head_dim, cuda=torch.cuda.is_available())
        if head_dim != config.model.head_dim:
            log.warning(
                "demo.head_dim_for_vllm",
                head_dim=head_dim,
                was=config.model.head_dim,
                why="vLLM's CPU attention has no smaller head size",
            )
            config.model = msgspec.structs.replace(config.model, head_dim=head_dim)
    t_start = time.perf_counter()
    run_dir = config.run_dir
    for stale in ("rl", "midtrained", "rl_trained"):
        shutil.rmtree(run_dir / stale, ignore_errors=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.run.seed)
    demo = config.demo
    threads = torch.get_num_threads()
    log.info("demo.start", run_dir=str(run_dir), time_cap_s=demo.time_cap_s or None)

    mid_cap = demo.midtrain_cap()
    deadline = None if mid_cap is None else t_start + mid_cap
    model, mid_info = midtrain_policy(config, deadline=deadline)
    t_mid = time.perf_counter() - t_start

    # The first evaluation runs beside RL (its engines at low priority, on the cores RL leaves
    # idle), unless a time cap needs its duration first to reserve the last one's.
    beside = (
        None if demo.time_cap_s or not EvalBeside.possible(config) else EvalBeside(model, config)
    )
    t_eval = 0.0
    if beside is None:
        t0 = time.perf_counter()
        before = evaluate_policy(model, config)
        t_eval = time.perf_counter() - t0
    rl_cap = None
    if demo.time_cap_s:
        # the final evaluation is reserved as long as the first took, and a margin
        rl_cap = demo.time_cap_s - (time.perf_counter() - t_start) - 1.15 * t_eval - 15.0
        rl_cap = max(rl_cap, 30.0)
        log.info("demo.rl_cap", seconds=round(rl_cap, 1), eval_s=round(t_eval, 1))
    summary = reinforce(model, config, progress=sys.stderr.isatty(), max_wall_s=rl_cap)
    save_policy(model, run_dir / "rl_trained", stage="rl", steps=summary.steps_done)
    if beside is not None:
        before, t_eval = beside.result(), beside.seconds
    t0 = time.perf_counter()
    after = evaluate_policy(model, config)
    t_eval_after = time.perf_counter() - t0
    wall = time.perf_counter() - t_start
    for name, result in (("eval_before.json", before), ("eval_after.json", after)):
        # per-task counts, for pairing this run with others
        (run_dir / name).write_bytes(msgspec.json.format(msgspec.json.encode(result)))
    rows = demo_table(
        config,
        before=before,
        after=after,
        summary=summary,
        mid_info=mid_info,
        stage_seconds={
            "mid-training": t_mid,
            "eval before" if beside is None else "eval before (beside RL)": t_eval,
            "RL": summary.wall_s,
            "eval after": t_eval_after,
            "total": wall,
        },
        threads=(
            ("mid-training/eval", threads),
            ("RL, engine and trainer each", config.rl.torch_threads or threads),
        ),
    )
    categories = category_rows(before, after, summary.category_reward)
    print_table(rows, categories)
    report = write_demo_report(config, rows, dump_config(config), categories, before, after)
    print(f"report: {report}")
    return 0
