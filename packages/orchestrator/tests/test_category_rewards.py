"""Training reward per task category: per step, and over the run."""

from __future__ import annotations

import pytest

from tandem.orchestrator.rl.category_rewards import CategoryRewards


def test_rewards_are_means_over_samples_per_step_and_for_the_run() -> None:
    table = CategoryRewards()
    table.record("gcd/off_by_one", [1.0, 0.0, 0.0, 0.0])
    table.record("gcd/off_by_one", [1.0, 1.0, 1.0, 1.0])
    table.record("chunked/wrong_operator", [0.0, 0.0])
    table.record("chunked/wrong_operator", [])  # nothing played: not a group
    assert table.take() == {
        "chunked/wrong_operator": {"groups": 1, "reward": 0.0},
        "gcd/off_by_one": {"groups": 2, "reward": 0.625},
    }
    assert table.take() == {}  # each group in one step's count
    table.record("gcd/off_by_one", [0.5, 0.5])
    assert table.take() == {"gcd/off_by_one": {"groups": 1, "reward": 0.5}}
    totals = table.totals()
    assert totals["gcd/off_by_one"]["groups"] == 3
    assert totals["gcd/off_by_one"]["reward"] == pytest.approx((1 + 4 + 1) / 10)
    assert totals["chunked/wrong_operator"] == {"groups": 1, "reward": 0.0}
