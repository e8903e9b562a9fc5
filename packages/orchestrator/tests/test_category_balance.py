"""`rl.category_balance`: a falling task category's groups weigh more in training, the
reported rewards stay the environment's."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
from group_stubs import StubCursor, StubRollouts
from rl_helpers import tiny_run

from tandem.orchestrator.artifacts.checkpoint import CheckpointManager
from tandem.orchestrator.config import (
    CategoryBalanceConfig,
    ConfigValueError,
    RLConfig,
    TaskConfig,
)
from tandem.orchestrator.rl.category_balance import CategoryBalance
from tandem.orchestrator.rl.groups import GroupSource
from tandem.orchestrator.rl.hooks import RunHooks
from tandem.orchestrator.rollout.tasks import TaskSource, task_category
from tandem.orchestrator.wire import Group


def _reference_weight(history: list[tuple[str, float]], category: str, cfg) -> float:
    """From the whole history: each category's moving average replayed group by group,
    then the clamped ratio of their mean to this category's."""
    running: dict[str, float] = {}
    for name, mean in history:
        running[name] = (
            mean if name not in running else (1 - cfg.ema) * running[name] + cfg.ema * mean
        )
    ratio = (sum(running.values()) / len(running)) / max(running[category], cfg.floor)
    return min(cfg.cap, max(1 / cfg.cap, ratio))


def test_weights_match_a_replay_of_the_history() -> None:
    cfg = CategoryBalanceConfig(enabled=True, cap=3.0, ema=0.3, floor=0.05)
    balance = CategoryBalance(cfg)
    rng = random.Random(0)
    history: list[tuple[str, float]] = []
    for _ in range(200):
        category = rng.choice(["a/x", "a/y", "b/x"])
        rewards = [
            float(rng.random() < {"a/x": 0.8, "a/y": 0.1, "b/x": 0.4}[category]) for _ in range(8)
        ]
        history.append((category, sum(rewards) / 8))
        got = balance.weight(category, rewards)
        assert got == pytest.approx(_reference_weight(history, category, cfg), rel=1e-12)
        assert 1 / 3 <= got <= 3
    weights = balance.weights()
    assert weights["a/y"] > 1 > weights["a/x"]  # the rarely solved category weighs more


def test_a_category_that_falls_gains_weight() -> None:
    balance = CategoryBalance(CategoryBalanceConfig(enabled=True))
    for _ in range(5):
        balance.weight("f/one", [1.0, 1.0, 0.0, 1.0])
        balance.weight("f/two", [1.0, 0.0, 1.0, 0.0])
    before = balance.weights()["f/two"]
    for _ in range(5):
        balance.weight("f/one", [1.0, 1.0, 1.0, 1.0])
        falling = balance.weight("f/two", [0.0, 0.0, 1.0, 0.0])
    assert falling > before > 1.0
    assert balance.weight("f/two", [0.0] * 4) <= 4.0  # capped


def test_training_rewards_are_scaled_and_the_category_table_is_not() -> None:
    groups = [[(1.0, 0), (1.0, 0), (1.0, 0), (0.0, 2)], [(1.0, 0), (0.0, 0), (0.0, 1), (0.0, 0)]]
    cursor = StubCursor()
    balance = CategoryBalance(CategoryBalanceConfig(enabled=True))
    source = GroupSource(StubRollouts(groups), cursor, RunHooks(), False, 0.25, balance)
    played = asyncio.run(source.play_step(2))
    # one category ("gcd/off_by_one" for every task of the stub cursor): running reward 0.75,
    # then 0.8 * 0.75 + 0.2 * 0.25 = 0.65; one category is its own mean, so both weights are 1
    assert [[s.reward for s in g.samples] for g in played] == [
        [1.0, 1.0, 1.0, -0.5],
        [1.0, 0.0, -0.25, 0.0],
    ]
    assert source.categories.totals() == {"gcd/off_by_one": {"groups": 2, "reward": 0.5}}

    class TwoCategories(StubCursor):
        def category(self, index: int) -> str:
            return ["gcd/off_by_one", "gcd/wrong_operator"][index]

    balance = CategoryBalance(CategoryBalanceConfig(enabled=True))
    source = GroupSource(StubRollouts(groups), TwoCategories(), RunHooks(), False, 0.0, balance)
    played = asyncio.run(source.play_step(2))
    # means 0.75 and 0.25: the second group's weight is 0.5 / 0.25 = 2
    assert [s.reward for s in played[1].samples] == [2.0, 0.0, 0.0, 0.0]
    assert balance.weights() == {
        "gcd/off_by_one": pytest.approx(0.667, abs=1e-3),
        "gcd/wrong_operator": 2.0,
    }


@pytest.mark.parametrize(
    ("field", "value"), [("cap", 0.5), ("ema", 0.0), ("ema", 1.5), ("floor", 0.0)]
)
def test_bad_settings_name_the_field(field: str, value: float) -> None:
    with pytest.raises(ConfigValueError, match=field):
        RLConfig(category_balance=CategoryBalanceConfig(enabled=True, **{field: value}))


def test_a_resumed_run_weighs_groups_as_the_uninterrupted_run(tmp_path: Path) -> None:
    """The running means go into the checkpoint and come back: the resumed run's groups get
    the weights a replay of every group since the first step gives."""
    source = TaskSource(TaskConfig(functions=["gcd", "digit_sum"]), 1)
    categories = {t.id: task_category(t) for t in source.take(0, 300)}
    names = sorted(set(categories.values()))
    raw: list[float] = []  # the current group's rewards so far
    played: list[tuple[str, list[float], list[float]]] = []  # category, raw, trained rewards

    def reward(sample) -> float:  # a group's samples in turn: 1, 0, 0 or 1, 1, 0 by category
        raw.append(float(len(raw) < 1 + names.index(categories[sample.task_id]) % 2))
        return raw[-1]

    def on_group(group: Group) -> None:
        trained = [s.reward for s in group.samples]
        played.append((categories[group.samples[0].task_id], raw[:], trained))
        raw.clear()

    def run(steps: int, run_dir: Path) -> None:
        rl = RLConfig(
            mode="sync",
            steps=steps,
            group_size=3,
            groups_per_step=2,
            checkpoint_every=1,
            category_balance=CategoryBalanceConfig(enabled=True, cap=3.0),
        )
        tiny_run(run_dir, rl, RunHooks(reward=reward, on_group=on_group), tasks=source).run()

    run_dir = tmp_path / "run"
    run(2, run_dir)
    first = len(played)
    saved = CheckpointManager(run_dir / "checkpoints").load(restore_rngs=False).meta.extra
    run(3, run_dir)
    cfg = CategoryBalanceConfig(enabled=True, cap=3.0)
    replay = CategoryBalance(cfg)
    for i, (category, rewards, trained) in enumerate(played):
        weight = replay.weight(category, rewards)
        assert trained == pytest.approx([weight * r for r in rewards], rel=1e-12), i
        if i == first - 1:
            assert saved["category_balance"] == pytest.approx(replay.state(), rel=1e-12)
    assert len(played) > first and len({c for c, _, _ in played}) > 1
    assert any(w != 1.0 for w in replay.weights().values())


def test_a_bad_saved_state_is_named() -> None:
    balance = CategoryBalance(CategoryBalanceConfig(enabled=True))
    with pytest.raises(ValueError, match="category balance state"):
        balance.load({"gcd/off_by_one": "high"})
