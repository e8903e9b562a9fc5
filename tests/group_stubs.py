"""Stand-ins for a rollout pool and a task cursor: groups of given (reward, tool errors)
samples, played through the real `GroupSource`."""

from __future__ import annotations

import numpy as np

from tandem.orchestrator.wire import PlayedGroup, Sample


def stub_sample(reward: float, tool_errors: int) -> Sample:
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


class StubRollouts:
    def __init__(self, groups: list[list[tuple[float, int]]]) -> None:
        self.groups = groups

    async def play(self, index: int, min_version: int = -1) -> PlayedGroup:
        return PlayedGroup(index=index, samples=[stub_sample(*s) for s in self.groups[index]])


class StubCursor:
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
