"""Task sources: generated bug-fix tasks (one bug, or the multi-bug family) addressed by a
cursor, so a resumed run continues.

Task ``i`` of a seed depends only on (seed, i) (agent-env's contract), so the cursor alone
says which tasks a run has used; training and held-out sets are different seeds.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from tandem.agent_env import Task, generate_multibug_tasks, generate_tasks
from tandem.orchestrator.config import CATEGORY_KEYS, TaskConfig


class TaskSource:
    """Task number ``offset + i`` of one seed, generated on demand (and cached)."""

    def __init__(self, config: TaskConfig, seed: int, offset: int = 0) -> None:
        self.config = config
        self.seed = seed
        self.offset = offset
        self._one = lru_cache(maxsize=4096)(self._generate)

    def _generate(self, index: int) -> Task:
        c = self.config
        if c.family == "multibug":
            return generate_multibug_tasks(
                self.seed,
                1,
                start=index,
                modules=c.repo_modules,
                buggy=c.buggy_modules,
                functions_per_module=c.functions_per_repo,
                kinds=tuple(c.kinds),
                hidden_per_function=c.hidden_per_function,
            )[0]
        return generate_tasks(
            self.seed,
            1,
            start=index,
            kinds=tuple(c.kinds),
            functions_per_repo=c.functions_per_repo,
            hidden_per_function=c.hidden_per_function,
            functions=c.functions or None,
            modules=c.modules or None,
            rename_locals=c.rename_locals,
        )[0]

    def __getitem__(self, index: int) -> Task:
        return self._one(self.offset + index)

    def take(self, start: int, n: int) -> list[Task]:
        return [self[i] for i in range(start, start + n)]


def task_category(task: Task, keys: Sequence[str] = CATEGORY_KEYS) -> str:
    """The values of the metadata fields ``keys``, joined by ``/`` (``?`` where a task has
    none): a category that scores and the curriculum break results down by. A task with
    none of them (a multi-bug repository has several functions and kinds) is one category
    per source and bug count, e.g. ``multibug/4``."""
    if not any(k in task.metadata for k in keys) and "source" in task.metadata:
        return "/".join(task.metadata[k] for k in ("source", "buggy") if k in task.metadata)
    return "/".join(task.metadata.get(k, "?") for k in keys)
