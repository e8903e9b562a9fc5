"""The demo's closing tables (before/after, agreement, sync figures; pass@1 per task category)
and its report files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tandem.app.headline import band_line, cut_short_line, lift_line, paired_lift
from tandem.app.machine import machine_line, this_machine
from tandem.app.pipeline_config import PipelineConfig
from tandem.app.rl_trace import trace_table


def _values(records: list[dict[str, Any]], key: str) -> list[float]:
    return [float(r[key]) for r in records if isinstance(r.get(key), int | float)]


def demo_table(
    config: PipelineConfig,
    *,
    before: Any,
    after: Any,
    summary: Any,
    mid_info: dict[str, Any],
    stage_seconds: dict[str, float],
    threads: tuple[tuple[str, int], ...],
) -> list[tuple[str, str]]:
    """Rows (metric, value): first the headline (a stage a time cap cut short, the paired
    lift and the README's band, the machine, wall times), then figures aggregated over the
    whole RL run from its metrics file."""
    return [
        *headline_rows(config, before, after, summary.steps_done, mid_info["steps"]),
        ("machine", machine_line(this_machine(), threads)),
        (
            f"wall time ({' / '.join(stage_seconds)})",
            " / ".join(f"{s:.0f} s" for s in stage_seconds.values()),
        ),
        *_run_rows(config, before, after, summary, mid_info),
    ]


def headline_rows(
    config: PipelineConfig, before: Any, after: Any, rl_steps: int, midtrain_steps: int
) -> list[tuple[str, str]]:
    """The report's first rows: any stage cut short, then the lift and how it compares."""
    demo = config.demo
    cuts = [
        cut_short_line(
            "mid-training",
            midtrain_steps,
            config.midtrain.steps,
            demo.midtrain_cap(),
            "demo.midtrain_cap_s" if demo.midtrain_cap_s else "demo.time_cap_s",
        ),
        cut_short_line("RL", rl_steps, config.rl.steps, demo.time_cap_s, "demo.time_cap_s"),
    ]
    rows = [("NOTE", c) for c in cuts if c is not None]
    lift = paired_lift(before, after)
    rows += [
        ("held-out pass@1 lift, paired by task", lift_line(lift)),
        ("compared with the README", band_line(lift, demo.lift_band)),
        (f"categories that lost more than {LOSS_FLAG_POINTS:g} points", losses_line(before, after)),
    ]
    return rows


LOSS_FLAG_POINTS = 10.0
"""A category whose held-out pass@1 fell by more than this many points is named beside the
headline: RL that trades a category the policy could already do for another is unlearning,
and a mean lift hides it."""


def losses_line(before: Any, after: Any) -> str:
    """The categories whose pass@1 fell by more than `LOSS_FLAG_POINTS`, each with its
    change and paired 95% interval; "none" when there is none."""
    from tandem.orchestrator import category_differences

    if not before.categories:
        return "n/a (the evaluations carry no task categories)"
    lost = [
        f"{name} {100 * d.mean:+.1f} ({100 * d.low:+.1f} to {100 * d.high:+.1f}, {d.tasks} tasks)"
        for name, d in category_differences([after], [before]).items()
        if 100 * d.mean < -LOSS_FLAG_POINTS
    ]
    return "LOST: " + "; ".join(lost) if lost else "none"


def _run_rows(
    config: PipelineConfig,
    before: Any,
    after: Any,
    summary: Any,
    mid_info: dict[str, Any],
) -> list[tuple[str, str]]:
    from tandem.orchestrator import fmt, read_metrics

    records = read_metrics(config.run_dir / "rl" / "metrics.jsonl")
    p0, p1 = before.pass_at.get(1, 0.0), after.pass_at.get(1, 0.0)
    mism = _values(records, "mismatch_max_abs")
    mism_tokens = sum(_values(records, "mismatch_tokens"))
    k3 = _values(records, "mismatch_k3")
    free_same = _values(records, "routing_agreement_same_version")
    free_all = _values(records, "routing_agreement_free")
    replay = _values(records, "routing_agreement_replay")
    sync = _values(records, "sync_bytes")
    ratios = _values(records, "sync_ratio")
    pause = summary.pause_s
    prepare = summary.prepare_s
    dense = None
    if summary.publish_bytes and summary.ratios:
        dense = summary.publish_bytes[0] * summary.ratios[0]
    roll = _values(records, "rollout_tokens_per_s")
    train_tps = _values(records, "trainer_tokens_per_s")
    fed = _values(records, "trainer_tokens_fed")
    shared = _values(records, "trainer_tokens_shared")

    def mean(xs: list[float]) -> float | None:
        return sum(xs) / len(xs) if xs else None

    hist = summary.staleness_histogram
    n_eval = f"{before.tasks} tasks x {before.samples_per_task}"
    used = sorted({str(r["trainer_replay"]) for r in records if r.get("trainer_replay")})
    replay_mode = "/".join(used) or config.trainer.replay
    if config.engine.kind == "vllm":
        engine = (
            f"vLLM server (rollouts and evaluations), model head_dim {config.model.head_dim}; "
            f"the trainer replays {replay_mode}"
        )
        if config.trainer.replay == "R3" and "R2" in used:
            engine += ", its own routes where vLLM reported no routed experts"
    else:
        engine = "embedded (the trainer's numerics, bit for bit)"
    return [
        ("inference engine", engine),
        ("held-out tasks (never trained on)", f"{n_eval}, seed {config.tasks.eval_seed}"),
        ("pass@1 mid-trained", fmt(p0)),
        ("pass@1 RL-trained", fmt(p1)),
        (
            "format errors per turn (before -> after)",
            f"{fmt(before.format_error_rate)} -> {fmt(after.format_error_rate)}",
        ),
        (
            "mid-training",
            f"{mid_info['steps']} of {config.midtrain.steps} steps, "
            f"{mid_info['transcripts']} oracle transcripts, "
            f"{mid_info['params'] / 1e6:.2f}M params",
        ),
        (
            "RL",
            f"{summary.steps_done} of {config.rl.steps} steps ({config.rl.mode}, max_staleness "
            f"{config.rl.max_staleness}), {summary.trajectories} trajectories",
        ),
        (
            "logprob mismatch, same-version samples (max |Δ|)",
            f"{fmt(max(mism) if mism else None, '.3g')} over {int(mism_tokens)} tokens",
        ),
        ("logprob mismatch k3 (mean)", fmt(mean(k3), ".3g")),
        (
            f"routing agreement with replay ({replay_mode})",
            fmt(min(replay) if replay else None, ".4f"),
        ),
        (
            "routing agreement without replay, same version",
            fmt(min(free_same) if free_same else None, ".4f"),
        ),
        ("routing agreement without replay, all samples", fmt(mean(free_all), ".4f")),
        (
            "staleness histogram (groups)",
            ", ".join(f"{k}: {v}" for k, v in sorted(hist.items())) or "n/a",
        ),
        (
            "dropped stale groups / filtered equal-reward groups / tasks passed over",
            f"{summary.dropped_stale} / {summary.filtered_equal} / "
            f"{summary.last_metrics.get('tasks_skipped', 0)}",
        ),
        (
            "weights synced per step (mean)",
            f"{fmt(mean(sync) / 1024 if sync else None, '.1f')} KiB of {fmt(dense / 1024 if dense else None, '.1f')} KiB dense",
        ),
        ("delta compression ratio (mean)", fmt(mean(ratios), ".2f")),
        (
            "engine prepare / pause per update (mean)",
            f"{fmt(mean(prepare), '.3f')} s / {fmt(mean(pause), '.4f')} s",
        ),
        (
            "rollout / trainer tokens per s (mean)",
            f"{fmt(mean(roll), '.0f')} / {fmt(mean(train_tps), '.0f')}",
        ),
        (
            "trainer tokens fed per step / prefix tokens not repeated (mean)",
            f"{fmt(mean(fed), '.0f')} / {fmt(mean(shared), '.0f')}",
        ),
        ("trainer idle fraction", fmt(summary.trainer_idle_fraction, ".2f")),
    ]


CATEGORY_COLUMNS = (
    "category",
    "tasks",
    "mid-trained",
    "RL-trained",
    "change (points)",
    "95% interval",
    "RL training reward",
)


def category_rows(
    before: Any, after: Any, training: dict[str, dict[str, float]] | None = None
) -> list[tuple[str, ...]]:
    """Held-out pass@1 per task category (function/bug kind), before and after RL, with the
    change paired by task and its 95% interval: where the change came from, and whether RL
    traded one category for another. ``training``: the RL run's reward per category over
    every group it played (`RunSummary.category_reward`)."""
    from tandem.orchestrator import category_differences, fmt

    differences = {}
    if before.categories and after.categories:
        differences = category_differences([after], [before])
    training = training or {}
    rows = []
    for name in sorted(set(before.by_category) | set(after.by_category)):
        b, a = before.by_category.get(name), after.by_category.get(name)
        change = "n/a" if b is None or a is None else f"{100 * (a.pass_at_1 - b.pass_at_1):+.1f}"
        d = differences.get(name)
        interval = "n/a" if d is None else f"{100 * d.low:+.1f} to {100 * d.high:+.1f}"
        seen = training.get(name)
        trained = "n/a" if seen is None else f"{seen['reward']:.2f} ({seen['groups']} groups)"
        rows.append(
            (
                name,
                str((b or a).tasks),
                fmt(b.pass_at_1 if b else None, ".2f"),
                fmt(a.pass_at_1 if a else None, ".2f"),
                change,
                interval,
                trained,
            )
        )
    return rows


def print_table(rows: list[tuple[str, str]], categories: list[tuple[str, ...]]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title="tandem demo: mid-training, then asynchronous GRPO")
    table.add_column("metric")
    table.add_column("value")
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)
    if categories:
        by_category = Table(title="held-out pass@1 per task category (function/bug kind)")
        for column in CATEGORY_COLUMNS:
            by_category.add_column(column, justify="left" if column == "category" else "right")
        for row in categories:
            by_category.add_row(*row)
        console.print(by_category)


def write_demo_report(
    config: PipelineConfig,
    rows: list[tuple[str, str]],
    config_toml: str,
    categories: list[tuple[str, ...]] | None,
    before: Any,
    after: Any,
) -> Path:
    from tandem.orchestrator import markdown_table, plot_rewards, read_metrics, write_report

    run_dir = config.run_dir
    header, trace = trace_table(read_metrics(run_dir / "rl" / "metrics.jsonl"))
    image = plot_rewards(
        run_dir / "rl" / "metrics.jsonl",
        run_dir / "reward_curve.png",
        baseline=before.pass_at.get(1),
        final=after.pass_at.get(1),
    )
    return write_report(
        run_dir / "report.md",
        title="tandem demo report",
        rows=rows,
        sections={
            **(
                {"Held-out pass@1 per task category": markdown_table(categories, CATEGORY_COLUMNS)}
                if categories
                else {}
            ),
            **(
                {
                    "RL step by step (training reward per category, every group played)": (
                        markdown_table(trace, header)
                    )
                }
                if trace
                else {}
            ),
            "Artefacts": (
                "- `midtrained/`, `rl_trained/`: policies in the Hugging Face Qwen3-MoE layout\n"
                "- `midtrain_metrics.jsonl`, `rl/metrics.jsonl`: per-step metrics\n"
                "- `eval_before.json`, `eval_after.json`: held-out scores, `solved` per task\n"
                "- `rl/checkpoints/`: resumable checkpoints; `rl/weights/`: the delta-sync streams"
            ),
        },
        config_toml=config_toml,
        image=image.name,
    )
