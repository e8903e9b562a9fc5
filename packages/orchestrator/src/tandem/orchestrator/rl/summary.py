"""What an RL run reports: the metrics of each step and the summary of the run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.orchestrator.rl.staleness import StalenessStats
from tandem.orchestrator.wire import Group, RolloutStats, compaction_figures


@dataclass
class RunSummary:
    steps_done: int
    policy_version: int
    wall_s: float
    trajectories: int
    trainer_busy_s: float
    trainer_wait_s: float
    dropped_stale: int
    filtered_equal: int
    staleness_histogram: dict[int, int]
    publish_bytes: list[int] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    pause_s: list[float] = field(default_factory=list)
    prepare_s: list[float] = field(default_factory=list)
    last_metrics: dict[str, Any] = field(default_factory=dict)
    engine_busy_s: float = 0.0  # in engine steps, summed over engines
    engine_s: float = 0.0  # engines (at the end) x seconds from the first group on
    # every group played, per task category: {category: {"groups": n, "reward": mean}}
    category_reward: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def trainer_idle_fraction(self) -> float:
        total = self.trainer_busy_s + self.trainer_wait_s
        return self.trainer_wait_s / total if total > 0 else 0.0

    @property
    def engine_busy_fraction(self) -> float:
        """The rollout side's counterpart of the trainer's idle fraction: the share of its time
        an engine spent in its steps, prefill and decode (the rest it waited for episodes:
        tool calls, grading, new groups, or a version it may not run ahead of)."""
        return self.engine_busy_s / self.engine_s if self.engine_s > 0 else 0.0


def step_metrics(
    groups: list[Group],
    stats: dict[str, Any],
    report: Any,
    t_wait: float,
    rollouts: RolloutStats,
    staleness: StalenessStats,
    counts: dict[str, int],
) -> dict[str, Any]:
    """One step's metrics line: the trainer's ``stats``, the publish ``report`` (None when
    nothing was published), the groups' rewards, their staleness, the engines' figures,
    and the run's running ``counts`` (trajectories, groups filtered, requeued, ...)."""
    samples = [s for g in groups for s in g.samples]
    tokens = sum(len(s.tokens) for s in samples)
    publish: dict[str, Any] = {}
    if report is not None:
        publish = {
            "sync_bytes": report.step_bytes,
            "sync_ratio": report.ratio,
            "sync_changed_frac": report.changed_fraction,
            "publish_s": report.seconds,
        }
    return {
        **stats,
        **publish,
        "reward": sum(s.reward for s in samples) / len(samples),
        "pass_rate": sum(s.resolved for s in samples) / len(samples),
        "format_errors": sum(s.format_errors for s in samples) / len(samples),
        "tool_errors": sum(s.tool_errors for s in samples) / len(samples),
        "turns": sum(s.turns for s in samples) / len(samples),
        **({} if not any(s.compactions for s in samples) else compaction_figures(samples)),
        "dropped_stale": staleness.dropped_stale,
        "dropped_fraction": staleness.dropped_fraction,
        "staleness_histogram": {
            str(k): v for k, v in sorted(staleness.staleness_histogram.items())
        },
        "trainer_tokens_per_s": tokens / max(stats["train_s"], 1e-9),
        "wait_s": t_wait,
        "rollout_tokens_sampled": rollouts.tokens_sampled,
        "engine_tokens_fed": rollouts.tokens_fed,
        "engine_tokens_reused": rollouts.tokens_reused,
        "engine_version": rollouts.engine_version,
        "engine_pause_s": rollouts.pause_s[-1] if rollouts.pause_s else None,
        "engine_prepare_s": rollouts.prepare_s[-1] if rollouts.prepare_s else None,
        "rollout_workers": rollouts.workers,
        "pull_failures": rollouts.pull_failures,
        "engine_busy_s": rollouts.busy_s,
        **counts,
    }
