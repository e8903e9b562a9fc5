"""A run of equal-reward groups ends a run that asked for it, once, and not before."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from tandem.orchestrator.rl.signal import SignalFilter


def group(*rewards: float) -> Any:
    """A group as the filter reads it: its samples' rewards."""
    return SimpleNamespace(samples=[SimpleNamespace(reward=r) for r in rewards])


def test_the_limit_counts_equal_groups_in_a_row_and_fires_once() -> None:
    calls: list[int] = []
    f = SignalFilter()
    f.give_up_after(3, lambda: calls.append(f.filtered))
    f.informative(group(0.0, 0.0))
    f.informative(group(1.0, 1.0))  # all rewarded counts too
    assert f.informative(group(0.0, 1.0))  # signal: the run starts again
    for _ in range(2):
        assert not f.informative(group(0.0, 0.0))
    assert calls == []
    assert not f.informative(group(0.0, 0.0))
    assert calls == [5]
    for _ in range(5):
        f.informative(group(0.0, 0.0))
    assert calls == [5]


def test_no_limit_by_default() -> None:
    f = SignalFilter()
    for _ in range(100):
        f.informative(group(0.0, 0.0))
    assert f.filtered == 100


def test_failed_groups_carry_a_signal_when_the_trainer_trains_them() -> None:
    """With ``trainer.loss.failed_group_advantage`` set, an all-failed group trains the
    policy: it passes the filter and counts as signal for the curriculum; all-rewarded and
    one-sample groups still do not."""
    from tandem.orchestrator.config import CurriculumConfig, TaskConfig
    from tandem.orchestrator.rollout.curriculum import SaturationFilter
    from tandem.orchestrator.rollout.tasks import TaskSource

    f = SignalFilter(train_failed=True)
    assert f.informative(group(0.0, 0.0, 0.0))
    assert f.informative(group(-1.0, 0.0))
    assert not f.informative(group(1.0, 1.0)) and not f.informative(group(0.0))
    assert f.filtered == 2 and not SignalFilter().informative(group(0.0, 0.0))

    task = TaskSource(TaskConfig(), 0)[0]
    cfg = CurriculumConfig(enabled=True, window=2)
    on, off = SaturationFilter(cfg, 0, train_failed=True), SaturationFilter(cfg, 0)
    for _ in range(2):
        on.record(task, [0.0, 0.0])
        off.record(task, [0.0, 0.0])
    category = on.category(task)
    assert not on.saturated(category) and off.saturated(category)
