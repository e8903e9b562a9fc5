"""`rl.tool_error_penalty`: failed calls lower the training reward, never the reported one."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tandem.orchestrator.config import ConfigValueError, RLConfig
from tandem.orchestrator.rl.groups import GroupSource
from tandem.orchestrator.rl.hooks import RunHooks
from tandem.orchestrator.wire import PlayedGroup, Sample


def _sample(reward: float, tool_errors: int) -> Sample:
    return Sample(
        task_id="t",
        tokens=[1, 2, 3],
        loss_mask=[0, 1, 1],
        logprobs=[0.0, -0.5, -0.5],
        versions=[-1, 0, 0],
        routes=np.zeros((2, 1, 1), dtype=np.uint8),
        reward=reward,
        resolved=reward > 0,
        turns=3,
        termination="submitted",
        min_version=0,
        max_version=0,
        tool_errors=tool_errors,
    )


class _Rollouts:
    def __init__(self, groups: list[list[tuple[float, int]]]) -> None:
        self.groups = groups

    async def play(self, index: int, min_version: int = -1) -> PlayedGroup:
        return PlayedGroup(index=index, samples=[_sample(*s) for s in self.groups[index]])


class _Cursor:
    skipped = 0

    def __init__(self) -> None:
        self.recorded: list[list[float]] = []
        self.i = -1

    def task(self, index: int):
        return type("T", (), {"id": f"task-{index}"})()

    def next_index(self) -> int:
        self.i += 1
        return self.i

    def category(self, index: int) -> str:
        return "gcd/off_by_one"

    def record(self, index: int, rewards) -> None:
        self.recorded.append(list(rewards))


def _source(groups, penalty: float) -> tuple[GroupSource, _Cursor]:
    cursor = _Cursor()
    return GroupSource(_Rollouts(groups), cursor, RunHooks(), False, penalty), cursor


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
