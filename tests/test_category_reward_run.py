"""Training reward per task category in a whole RL run: each step's line and the summary
count every group played, equal-reward ones included (the trainer never sees those)."""

from __future__ import annotations

from pathlib import Path

from rl_helpers import parity, tiny_run

from tandem.orchestrator.artifacts.metrics import read_metrics
from tandem.orchestrator.config import RLConfig
from tandem.orchestrator.rl.hooks import RunHooks
from tandem.orchestrator.rollout.tasks import task_category


def test_training_reward_per_category_counts_every_group_played(tmp_path: Path) -> None:
    """Each step's line gives the reward of every group played since the step before, per
    task category, equal-reward groups included (the trainer never sees those); the run's
    summary gives them all. Checked against the groups as they were played, whose task ids
    name their categories through the task source."""
    played: list[tuple[str, list[float]]] = []
    hooks = RunHooks(
        reward=parity,
        on_group=lambda g: played.append((g.samples[0].task_id, [s.reward for s in g.samples])),
    )
    rl = RLConfig(mode="pipelined", steps=3, group_size=3, groups_per_step=2, checkpoint_every=9)
    run = tiny_run(tmp_path, rl, hooks)
    summary = run.run()
    category = {run.tasks[i].id: task_category(run.tasks[i]) for i in range(run.cursor.cursor)}
    want: dict[str, list[float]] = {}
    for task_id, rewards in played:
        want.setdefault(category[task_id], []).append(sum(rewards) / len(rewards))
    assert summary.category_reward == {
        c: {"groups": len(v), "reward": round(sum(v) / len(v), 4)} for c, v in sorted(want.items())
    }
    records = read_metrics(tmp_path / "metrics.jsonl")
    per_step = [r["category_reward"] for r in records]
    assert per_step[0]  # the first step waited for groups (later ones may find them counted)
    # every group finished before the last step's line is in exactly one step's count
    counted = sum(row["groups"] for step in per_step for row in step.values())
    assert 2 * 3 <= counted <= len(played)
    assert sum(row["groups"] for row in summary.category_reward.values()) == len(played)
