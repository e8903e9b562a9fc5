"""The curriculum's saturation filter: which tasks at the cursor are played."""

from __future__ import annotations

import pytest

from tandem.agent_env import HiddenTests, Task
from tandem.orchestrator.config import ConfigValueError, CurriculumConfig, TaskConfig
from tandem.orchestrator.rollout.curriculum import CuratedCursor, SaturationFilter
from tandem.orchestrator.rollout.tasks import TaskSource


def task(function: str, kind: str = "off_by_one") -> Task:
    return Task(
        id=f"{function}-{kind}",
        instruction="fix it",
        hidden_tests=HiddenTests(fail_to_pass=("t",)),
        metadata={"function": function, "bug_kind": kind},
    )


ON = CurriculumConfig(enabled=True, window=3, keep=0.2)


def admitted(f: SaturationFilter, t: Task, n: int = 4000) -> float:
    return sum(f.admits(i, t) for i in range(n)) / n


def test_disabled_plays_every_task_and_keeps_no_history() -> None:
    f = SaturationFilter(CurriculumConfig(), seed=0)
    for _ in range(5):
        f.record(task("gcd"), [1.0, 1.0])
    assert f.history == {} and admitted(f, task("gcd"), 200) == 1.0 and f.skipped == 0


def test_a_category_without_signal_is_mostly_passed_over() -> None:
    f = SaturationFilter(ON, seed=0)
    gcd, other = task("gcd"), task("gcd", "swapped_arguments")
    for _ in range(2):
        f.record(gcd, [0.0, 0.0, 0.0])
    assert not f.saturated(f.category(gcd)) and admitted(f, gcd, 200) == 1.0  # 2 < window
    f.record(gcd, [1.0, 1.0, 1.0])  # all solved is no signal either
    assert f.saturated("gcd/off_by_one")
    share = admitted(f, gcd)
    assert 0.17 < share < 0.23  # keep = 0.2 of 4000 hashed indices (sd 0.006)
    assert f.skipped == round(4000 * (1 - share))
    assert admitted(f, other, 200) == 1.0  # another category is untouched


def test_one_group_with_signal_in_the_window_plays_the_category_again() -> None:
    f = SaturationFilter(ON, seed=0)
    t = task("fizzbuzz")
    for rewards in ([0.0] * 3, [0.0] * 3, [0.0] * 3, [1.0, 0.0, 0.0]):
        f.record(t, rewards)
    assert not f.saturated(f.category(t)) and admitted(f, t, 200) == 1.0
    for _ in range(2):
        f.record(t, [0.0] * 3)
    assert not f.saturated(f.category(t))  # the signal is still among the last three
    f.record(t, [0.0] * 3)
    assert f.saturated(f.category(t)) and len(f.history["fizzbuzz/off_by_one"]) == 3


def test_choices_depend_on_seed_and_index_and_survive_a_checkpoint() -> None:
    t = task("gcd")
    a, b = SaturationFilter(ON, seed=0), SaturationFilter(ON, seed=1)
    for f in (a, b):
        for _ in range(3):
            f.record(t, [0.0, 0.0])
    picks_a = [a.admits(i, t) for i in range(300)]
    assert picks_a != [b.admits(i, t) for i in range(300)]
    restored = SaturationFilter(ON, seed=0)
    restored.load(a.state())
    assert restored.history == a.history and restored.skipped == a.skipped
    assert [restored.admits(i, t) for i in range(300, 600)] == [
        a.admits(i, t) for i in range(300, 600)
    ]
    fresh = SaturationFilter(ON, seed=0)
    fresh.load({})  # a checkpoint written without a curriculum
    assert fresh.history == {} and fresh.skipped == 0


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [({"keep": 0.0}, "keep"), ({"window": 0}, "window"), ({"keys": []}, "keys")],
)
def test_bad_settings_name_the_key(kwargs: dict, key: str) -> None:
    with pytest.raises(ConfigValueError, match=f"^{key}:"):
        CurriculumConfig(**kwargs)


def test_the_cursor_passes_over_saturated_tasks_and_resumes_from_its_state() -> None:
    source = TaskSource(TaskConfig(functions=["gcd", "digit_sum"], kinds=["off_by_one"]), 1)
    cursor = CuratedCursor(
        source, CurriculumConfig(enabled=True, keys=["function"], window=1, keep=0.2), seed=0
    )
    first = cursor.next_index()
    cursor.record(first, [1.0, 1.0])  # no signal: that function is saturated now
    saturated = source[first].metadata["function"]
    state = cursor.state()
    picked = [cursor.next_index() for _ in range(40)]
    passed = set(range(first + 1, cursor.cursor)) - set(picked)
    assert passed and cursor.skipped == len(passed)
    assert {source[i].metadata["function"] for i in passed} == {saturated}
    again = CuratedCursor(source, cursor.filter.config, seed=0)
    again.load(state)  # a resumed run picks the same tasks
    assert [again.next_index() for _ in range(40)] == picked
