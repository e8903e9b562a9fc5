"""Detours: oracle transcripts that try a wrong fix first, read the tool's error, and recover.

A small policy mid-trained on the oracle alone learns each function's fixes as text to
recall, not as text to copy from the file it just read: it sends the edit of one of the
function's bug kinds whatever the file holds (docs/experiments.md). Given one edit per
episode, RL then moves all of a function's tries to the fix that pays most often and the
sibling bug kinds fall to 0. An agent with a few turns to spare can do what a person does
instead: when the edit's old text is not in the file (the tool says so), try the next fix.

A detour is the edit a sibling task of the same function needs (narrowed as the oracle's
own, `minimal_edit`) whose old text is not in this task's file, so the real tool answers it
with its error; the transcript then goes on with the task's own fix. The choice of tasks and
decoys depends only on the task ids, so the transcripts are the same on every run.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from tandem.agent_env import Task

Edit = tuple[str, str, str]
"""(path, old_string, new_string) of an `edit` call."""

Narrow = Callable[[str, str, str], tuple[str, str]]
"""(file text, old, new) -> the (old, new) the oracle sends (`minimal_edit`)."""


def _family(task: Task) -> str | None:
    return task.metadata.get("function")


def _own_edits(task: Task, narrow: Narrow) -> list[Edit]:
    out = []
    for e in task.reference_edits:
        text = task.files.get(e.path)
        if text is not None:
            out.append((e.path, *narrow(text, e.old, e.new)))
    return out


def plan_detours(
    tasks: Sequence[Task], fraction: float, max_detours: int, narrow: Narrow
) -> dict[str, list[Edit]]:
    """Task id -> the wrong edits its transcript sends before its own fix.

    About ``fraction`` of the tasks get 1 to ``max_detours`` detours, each the fix of a
    sibling task (same function, same file path) whose old text is absent from this task's
    file; tasks without such a sibling get none.
    """
    if fraction <= 0 or max_detours < 1:
        return {}
    by_family: dict[str, list[Edit]] = {}
    for t in tasks:
        family = _family(t)
        if family is not None:
            by_family.setdefault(family, []).extend(_own_edits(t, narrow))
    plans: dict[str, list[Edit]] = {}
    for t in tasks:
        rng = random.Random(f"detour:{t.id}")
        family = _family(t)
        if family is None or rng.random() >= fraction or not t.reference_edits:
            continue
        path = t.reference_edits[0].path
        text = t.files.get(path, "")
        decoys = sorted({e for e in by_family[family] if e[0] == path and e[1] not in text})
        distinct: dict[str, Edit] = {e[1]: e for e in decoys}  # one per old text
        if not distinct:
            continue
        pool = list(distinct.values())
        rng.shuffle(pool)
        plans[t.id] = pool[: rng.randint(1, max_detours)]
    return plans
