"""The long-horizon comparison: what an episode does when its context fills, side by side.

One mid-trained policy (its transcripts cut into contexts with the oracle's summaries), then
for each variant the same held-out tasks before and after the same number of RL steps:

- ``none``: the episode ends when the window is full;
- ``sliding``: the oldest turns are dropped;
- ``prompted``: the policy summarises when asked, but the summary is masked out of the loss;
- ``trained``: the summary is trained by the episode's reward like every other token.

``prompted`` and ``trained`` play alike before RL (the mask only matters to the trainer), so
they share one evaluation before per seed (the seed chooses the evaluation's draws too, so
before and after are paired draw for draw). Each RL run starts from the saved mid-trained
weights.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import structlog

from tandem.app.pipeline_config import CompareSettings, PipelineConfig

log = structlog.get_logger()


def variant_config(config: PipelineConfig, variant: str, seed: int) -> PipelineConfig:
    """``config`` with the variant's compaction and the RL seed."""
    mode = {"none": "none", "sliding": "sliding"}.get(variant, "summary")
    compaction = msgspec.structs.replace(
        config.episode.compaction, mode=mode, train_summary=variant == "trained"
    )
    episode = msgspec.structs.replace(config.episode, compaction=compaction)
    run = msgspec.structs.replace(config.run, seed=seed)
    return msgspec.structs.replace(config, episode=episode, run=run)


def _play_key(variant: str) -> str:
    return "summary" if variant in ("prompted", "trained") else variant


def run_compare(config: PipelineConfig, settings: CompareSettings) -> list[dict[str, Any]]:
    """Mid-train once, then evaluate and train every variant; returns one row per RL run
    and writes ``compare.json`` and ``compare.md`` in the run directory."""
    from tandem.orchestrator import (
        evaluate_policy,
        load_policy,
        midtrain_policy,
        paired_difference,
        reinforce,
    )

    run_dir = config.run_dir
    t_start = time.perf_counter()
    midtrain_policy(config)
    t_mid = time.perf_counter() - t_start
    log.info("compare.midtrained", seconds=round(t_mid, 1))
    policy_dir = run_dir / "midtrained"
    before: dict[tuple[str, int], Any] = {}
    rows: list[dict[str, Any]] = []
    for variant in settings.variants:
        seeds = settings.seeds if variant in ("prompted", "trained") else 1
        for k in range(seeds):
            cfg = variant_config(config, variant, config.run.seed + k)
            key = (_play_key(variant), cfg.run.seed)  # the seed chooses the evaluation's draws
            if key not in before:
                before[key] = evaluate_policy(load_policy(policy_dir), cfg)
            t0 = time.perf_counter()
            model = load_policy(policy_dir)
            summary = reinforce(model, cfg, run_dir=run_dir / f"rl_{variant}_s{cfg.run.seed}")
            after = evaluate_policy(model, cfg)
            lift = paired_difference([after], [before[key]])
            row = {
                "variant": variant,
                "seed": cfg.run.seed,
                "before": before[key].pass_at[1],
                "after": after.pass_at[1],
                "lift": lift.mean,
                "low": lift.low,
                "high": lift.high,
                "reward_before": before[key].mean_reward,
                "reward_after": after.mean_reward,
                "turns": after.mean_turns,
                "compaction": after.compaction,
                "terminations": after.terminations,
                "rl_steps": summary.steps_done,
                "seconds": time.perf_counter() - t0,
            }
            rows.append(row)
            log.info("compare.variant", **{k: v for k, v in row.items() if k != "terminations"})
    wall = time.perf_counter() - t_start
    (run_dir / "compare.json").write_bytes(
        msgspec.json.format(
            msgspec.json.encode({"rows": rows, "wall_s": wall, "midtrain_s": t_mid})
        )
    )
    text = compare_table(rows, wall)
    (run_dir / "compare.md").write_text(text)
    print(text)
    return rows


def compare_table(rows: list[dict[str, Any]], wall_s: float) -> str:
    """The comparison as a Markdown table: pass@1 (all of a task's bugs fixed) in points,
    its lift with a 95% interval paired by task; the mean reward (with partial credit, the
    share of hidden tests that pass), mean turns and compactions per episode, summary
    length against the context it replaced (tokens) and the share of summaries cut."""
    lines = [
        "| variant | seed | pass@1 before | after | lift (95% interval) | reward before -> after "
        "| turns | summaries | summary / replaced tokens | cut |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        c = r["compaction"] or {}
        ratio = (
            f"{c['summary_tokens']:.0f} / {c['replaced_tokens']:.0f}"
            if c.get("summary_tokens")
            else (f"- / {c['replaced_tokens']:.0f}" if c else "-")
        )
        lines.append(
            f"| {r['variant']} | {r['seed']} | {100 * r['before']:.1f} | {100 * r['after']:.1f} "
            f"| {100 * r['lift']:+.1f} ({100 * r['low']:+.1f} to {100 * r['high']:+.1f}) "
            f"| {r['reward_before']:.3f} -> {r['reward_after']:.3f} | {r['turns']:.1f} "
            f"| {c.get('compactions', 0.0):.2f} "
            f"| {ratio} | {c.get('summaries_cut', 0.0):.2f} |"
        )
    lines.append(f"\nwall time: {wall_s / 60:.1f} min")
    return "\n".join(lines) + "\n"
