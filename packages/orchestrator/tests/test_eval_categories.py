"""pass@1 per task category: the breakdown agrees with a count by hand and with the total."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.agent_env import generate_multibug_tasks, generate_tasks
from tandem.orchestrator.eval.passk import EvalResult, by_category, paired_difference, summarize
from tandem.orchestrator.rollout.tasks import task_category
from tandem.orchestrator.wire import Sample


def _sample(resolved: bool) -> Sample:
    return Sample(
        task_id="t",
        tokens=[1, 2, 3],
        loss_mask=[0, 1, 1],
        logprobs=[0.0, -0.1, -0.2],
        versions=[-1, 0, 0],
        routes=np.zeros((2, 1, 1), dtype=np.uint8),
        reward=float(resolved),
        resolved=resolved,
        turns=1,
        termination="test",
        min_version=0,
        max_version=0,
    )


def test_category_scores_match_a_count_by_hand() -> None:
    solved = [[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]]
    per_task = [[_sample(bool(x)) for x in row] for row in solved]
    categories = [
        "gcd/off_by_one",
        "gcd/swapped",
        "fizzbuzz/off_by_one",
        "gcd/off_by_one",
        "gcd/swapped",
    ]

    result = summarize(per_task, (1,), categories)

    # gcd/off_by_one: tasks 0 and 3 -> (2/4 + 1/4) / 2; gcd/swapped: tasks 1 and 4 -> (1 + 0) / 2
    assert list(result.by_category) == ["fizzbuzz/off_by_one", "gcd/off_by_one", "gcd/swapped"]
    assert result.by_category["gcd/off_by_one"].tasks == 2
    assert result.by_category["gcd/off_by_one"].pass_at_1 == pytest.approx(0.375)
    assert result.by_category["gcd/swapped"].pass_at_1 == pytest.approx(0.5)
    assert result.by_category["fizzbuzz/off_by_one"].pass_at_1 == 0.0
    # weighted by task count, the categories give back the overall pass@1
    total = sum(c.tasks * c.pass_at_1 for c in result.by_category.values()) / len(per_task)
    assert total == pytest.approx(result.pass_at[1])
    assert summarize(per_task, (1,)).by_category == {}
    assert result.solved == [2, 4, 0, 1, 0]


def test_category_count_must_match_the_tasks() -> None:
    with pytest.raises(ValueError, match="2 categories for 3 tasks"):
        by_category([[_sample(True)]] * 3, ["a", "b"])


def test_task_category_reads_function_and_bug_kind() -> None:
    tasks = generate_tasks(5, 6, functions_per_repo=1, functions=["gcd"])
    for t in tasks:
        assert task_category(t) == f"gcd/{t.metadata['bug_kind']}"
    assert task_category(tasks[0], ("function", "no_such_field")) == "gcd/?"


def test_a_multibug_task_is_one_category_per_bug_count() -> None:
    task = generate_multibug_tasks(5, 1, modules=4, buggy=3)[0]
    assert task_category(task) == "multibug/3"


def _scored(solved: list[list[int]]) -> EvalResult:
    return summarize([[_sample(bool(x)) for x in row] for row in solved], (1,))


def test_paired_difference_matches_the_means_and_a_hand_computed_interval() -> None:
    a = _scored([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0]])
    b = _scored([[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]])

    d = paired_difference([a], [b])

    # per task: +0.5, 0, 0, +0.5 -> mean 0.25, sample sd sqrt(1/12), half 1.96 * sd / 2
    assert d.tasks == 4
    assert d.mean == pytest.approx(a.pass_at[1] - b.pass_at[1])
    assert d.mean == pytest.approx(0.25)
    half = 1.96 * (1 / 12) ** 0.5 / 2
    assert (d.low, d.high) == (pytest.approx(0.25 - half), pytest.approx(0.25 + half))
    # two runs of a side average task by task: the mean is the runs' mean difference
    c = _scored([[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    two = paired_difference([a, c], [b])
    assert two.mean == pytest.approx((a.pass_at[1] + c.pass_at[1]) / 2 - b.pass_at[1])


def test_paired_difference_rejects_results_on_other_tasks() -> None:
    a = _scored([[1, 0], [1, 1], [0, 0]])
    with pytest.raises(ValueError, match="same tasks"):
        paired_difference([a], [_scored([[1, 0], [1, 1]])])
    with pytest.raises(ValueError, match="at least one result"):
        paired_difference([a], [])
