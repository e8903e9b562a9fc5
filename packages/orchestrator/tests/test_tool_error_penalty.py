"""`rl.tool_error_penalty`: failed calls lower the training reward, never the reported one."""

from __future__ import annotations

import asyncio

import pytest
from group_stubs import StubCursor, StubRollouts

from tandem.orchestrator.config import ConfigValueError, RLConfig
from tandem.orchestrator.rl.groups import GroupSource
from tandem.orchestrator.rl.hooks import RunHooks


def _source(groups, penalty: float) -> tuple[GroupSource, StubCursor]:
    cursor = StubCursor()
    return GroupSource(StubRollouts(groups), cursor, RunHooks(), False, penalty), cursor


def test_failed_calls_rank_the_samples_of_an_all_failed_group() -> None:
    groups = [[(0.0, 0), (0.0, 1), (0.0, 2), (0.0, 1)], [(1.0, 0), (0.0, 1), (1.0, 1), (0.0, 0)]]
    source, cursor = _source(groups, 0.25)
    played = asyncio.run(source.play_step(2))
    # without the penalty the first group would be equal-reward and filtered out
    assert [[s.reward for s in g.samples] for g in played] == [
        [0.0, -0.25, -0.5, -0.25],
        [1.0, -0.25, 0.75, 0.0],
    ]
    assert cursor.recorded == [[0.0, -0.25, -0.5, -0.25], [1.0, -0.25, 0.75, 0.0]]
    # the per-category table keeps the environment's rewards: 0 and 2 of 4 solved
    assert source.categories.totals() == {"gcd/off_by_one": {"groups": 2, "reward": 0.25}}


def test_without_a_penalty_rewards_are_the_environments() -> None:
    groups = [[(0.0, 0), (0.0, 3), (0.0, 1), (0.0, 0)], [(1.0, 2), (0.0, 1), (1.0, 0), (0.0, 0)]]
    source, _ = _source(groups, 0.0)
    played = asyncio.run(source.play_step(1))
    assert [[s.reward for s in g.samples] for g in played] == [[1.0, 0.0, 1.0, 0.0]]


def test_negative_penalty_names_the_field() -> None:
    with pytest.raises(ConfigValueError, match="tool_error_penalty"):
        RLConfig(tool_error_penalty=-0.1)
