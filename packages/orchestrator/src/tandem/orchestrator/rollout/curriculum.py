"""Passing over tasks whose category gives GRPO no signal.

A group whose samples all get the same reward (every one solved, or none) adds nothing to a
GRPO step: its advantages are all zero. A small policy can be all-or-nothing on whole
categories of tasks (a bug kind in one function it never fixes, another it always fixes),
and then most rollouts are spent on groups the trainer throws away. `SaturationFilter`
remembers, per category, whether its recent groups had a signal, and lets the cursor pass
over most tasks of a category whose last few groups had none, so the rollouts go to tasks
that can teach. A saturated category is never shut out: a ``keep`` fraction of its tasks is
still played, so one that becomes learnable as the policy changes is seen again.
`CuratedCursor` is the run's cursor over a task source with the filter applied.

Which tasks are kept depends only on the run's seed, the task's index and the groups seen
so far (a hash, not a shared random stream), and the history is part of the checkpoint, so
a resumed sync or pipelined run makes the choices the uninterrupted one made.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from tandem.agent_env import Task
from tandem.orchestrator.config import CurriculumConfig
from tandem.orchestrator.rollout.tasks import TaskSource, task_category
from tandem.orchestrator.wire import has_signal


class SaturationFilter:
    """Per task category, whether each of its recent groups had a reward signal."""

    def __init__(self, config: CurriculumConfig, seed: int, train_failed: bool = False) -> None:
        self.config = config
        self.seed = seed
        self.train_failed = train_failed
        self.history: dict[str, list[bool]] = {}
        self.skipped = 0

    def category(self, task: Task) -> str:
        """The values of the configured metadata fields (``?`` where a task has none)."""
        return task_category(task, self.config.keys)

    def record(self, task: Task, rewards: Sequence[float]) -> None:
        """One finished group of ``task``: informative when it trains the policy
        (`has_signal`)."""
        if not self.config.enabled:
            return
        seen = self.history.setdefault(self.category(task), [])
        seen.append(has_signal(rewards, self.train_failed))
        del seen[: -self.config.window]

    def saturated(self, category: str) -> bool:
        """Whether the category's last ``window`` groups all had one reward each."""
        seen = self.history.get(category, [])
        return len(seen) >= self.config.window and not any(seen)

    def admits(self, index: int, task: Task) -> bool:
        """Whether task ``index`` is played; a pass-over is counted in ``skipped``."""
        if not self.config.enabled or not self.saturated(self.category(task)):
            return True
        digest = hashlib.blake2b(f"{self.seed}:{index}".encode(), digest_size=8).digest()
        if int.from_bytes(digest, "little") / 2**64 < self.config.keep:
            return True
        self.skipped += 1
        return False

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps (JSON-able)."""
        return {"history": {k: list(v) for k, v in self.history.items()}, "skipped": self.skipped}

    def load(self, state: dict[str, Any]) -> None:
        """Restore a `state` from a checkpoint (an empty one for checkpoints made without)."""
        self.history = {str(k): [bool(x) for x in v] for k, v in state.get("history", {}).items()}
        self.skipped = int(state.get("skipped", 0))


class CuratedCursor:
    """The run's task cursor (`TaskCursor`): task ``cursor``, ``cursor + 1``, ... of a task
    source, passing over the ones the curriculum leaves out (counted in ``skipped``)."""

    def __init__(
        self, tasks: TaskSource, config: CurriculumConfig, seed: int, train_failed: bool = False
    ) -> None:
        self.tasks = tasks
        self.filter = SaturationFilter(config, seed, train_failed)
        self.cursor = 0

    @property
    def skipped(self) -> int:
        return self.filter.skipped

    def task(self, index: int) -> Task:
        return self.tasks[index]

    def category(self, index: int) -> str:
        return task_category(self.tasks[index])

    def next_index(self) -> int:
        while True:
            index = self.cursor
            self.cursor += 1
            if self.filter.admits(index, self.tasks[index]):
                return index

    def record(self, index: int, rewards: Sequence[float]) -> None:
        self.filter.record(self.tasks[index], rewards)

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps (JSON-able, a copy)."""
        return {"cursor": self.cursor, "curriculum": self.filter.state()}

    def load(self, state: dict[str, Any]) -> None:
        self.cursor = int(state.get("cursor", 0))
        self.filter.load(state.get("curriculum", {}))
