"""Scores of a policy on a task set: pass@k, per category, and paired between two policies.

pass@k uses the unbiased estimator of Chen et al. (2021): with n samples of a task of which
c pass, pass@k = 1 - C(n - c, k) / C(n, k), averaged over tasks.

pass@1 is also broken down by task category (function and bug kind of a generated task): a
small policy can be all-or-nothing per category, and an overall figure hides an RL run that
trades one category for another.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from math import comb

import msgspec

from tandem.orchestrator.wire import Sample, compaction_figures


class CategoryScore(msgspec.Struct, frozen=True):
    """pass@1 over the tasks of one category."""

    tasks: int
    pass_at_1: float


class EvalResult(msgspec.Struct, frozen=True):
    """Scores of one policy on a task set. ``solved[i]``: how many of task i's samples were
    resolved, in task order, so that two policies scored on the same tasks can be compared
    task by task (a paired difference is far less noisy than two separate means)."""

    tasks: int
    samples_per_task: int
    pass_at: dict[int, float]
    mean_reward: float
    format_error_rate: float
    mean_turns: float
    infra_faults: int
    by_category: dict[str, CategoryScore] = {}
    solved: list[int] = []
    categories: list[str] = []  # task i's category, when the scorer was given them
    compaction: dict[str, float] = {}
    """`compaction_figures` of the episodes (empty when none compacted its context)."""
    terminations: dict[str, int] = {}


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one task with n samples of which c are correct."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per task, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


class PairedDifference(msgspec.Struct, frozen=True):
    """pass@1 of policy A minus that of policy B on the same tasks: the mean over tasks of the
    per-task difference, with a normal 95% interval over tasks (``low``, ``high``)."""

    tasks: int
    mean: float
    low: float
    high: float


def paired_difference(a: Sequence[EvalResult], b: Sequence[EvalResult]) -> PairedDifference:
    """pass@1 of ``a`` minus ``b``, paired task by task.

    ``a`` and ``b`` hold one or more results each (runs of each policy, say one per benchmark
    round), all scored on the same tasks in the same order; a task's difference is the mean
    over ``a``'s runs of its pass@1 minus the mean over ``b``'s. Pairing removes what the
    tasks share (an easy task is easy for both), leaving the noise of the samples and runs.
    """
    runs = [*a, *b]
    if not a or not b:
        raise ValueError("paired_difference needs at least one result on each side")
    n_tasks = runs[0].tasks
    for r in runs:
        if r.tasks != n_tasks or len(r.solved) != n_tasks or r.samples_per_task < 1:
            raise ValueError(
                f"paired_difference needs results on the same tasks with per-task counts: "
                f"got {r.tasks} tasks ({len(r.solved)} counts, {r.samples_per_task} samples "
                f"each) against {n_tasks}"
            )
    if n_tasks < 2:
        raise ValueError(f"paired_difference needs at least 2 tasks, got {n_tasks}")

    return _paired(_task_differences(a, b), range(n_tasks))


def _task_differences(a: Sequence[EvalResult], b: Sequence[EvalResult]) -> list[float]:
    def rate(side: Sequence[EvalResult], i: int) -> float:
        return sum(r.solved[i] / r.samples_per_task for r in side) / len(side)

    return [rate(a, i) - rate(b, i) for i in range(a[0].tasks)]


def _paired(diffs: Sequence[float], tasks: Sequence[int]) -> PairedDifference:
    """Mean and normal 95% interval of ``diffs`` over the task indices ``tasks``."""
    n = len(tasks)
    mean = sum(diffs[i] for i in tasks) / n
    var = sum((diffs[i] - mean) ** 2 for i in tasks) / (n - 1) if n > 1 else 0.0
    half = 1.96 * (var / n) ** 0.5
    return PairedDifference(tasks=n, mean=mean, low=mean - half, high=mean + half)


def category_differences(
    a: Sequence[EvalResult], b: Sequence[EvalResult]
) -> dict[str, PairedDifference]:
    """`paired_difference` within each task category (sorted by name): where a lift came
    from, and which categories a policy lost. Needs results scored with each task's category
    (``EvalResult.categories``); a category of one task gets a zero-width interval."""
    paired_difference(a, b)  # the same checks: same tasks, per-task counts
    categories = a[0].categories
    if len(categories) != a[0].tasks or any(r.categories != categories for r in [*a, *b]):
        raise ValueError(
            "category_differences needs results scored with the same per-task categories "
            "(EvalResult.categories)"
        )
    diffs = _task_differences(a, b)
    members: dict[str, list[int]] = {}
    for i, category in enumerate(categories):
        members.setdefault(category, []).append(i)
    return {c: _paired(diffs, members[c]) for c in sorted(members)}


def by_category(
    per_task: Sequence[Sequence[Sample]], categories: Sequence[str]
) -> dict[str, CategoryScore]:
    """pass@1 per category (``categories[i]`` is task i's), categories in sorted order."""
    if len(categories) != len(per_task):
        raise ValueError(f"{len(categories)} categories for {len(per_task)} tasks")
    scores: dict[str, list[float]] = {}
    for category, samples in zip(categories, per_task, strict=True):
        solved = sum(s.resolved for s in samples)
        scores.setdefault(category, []).append(pass_at_k(len(samples), solved, 1))
    return {
        c: CategoryScore(tasks=len(v), pass_at_1=sum(v) / len(v)) for c, v in sorted(scores.items())
    }


def summarize(
    per_task: Sequence[Sequence[Sample]],
    ks: Sequence[int],
    categories: Sequence[str] | None = None,
) -> EvalResult:
    """Scores of ``per_task`` (samples of each task); ``categories``: each task's category,
    for the per-category breakdown."""
    n = len(per_task[0]) if per_task else 0
    flat = [s for t in per_task for s in t]
    turns = sum(s.turns for s in flat)
    return EvalResult(
        tasks=len(per_task),
        samples_per_task=n,
        pass_at={
            k: sum(pass_at_k(len(t), sum(s.resolved for s in t), k) for t in per_task)
            / max(len(per_task), 1)
            for k in ks
            if k <= n
        },
        mean_reward=sum(s.reward for s in flat) / max(len(flat), 1),
        format_error_rate=sum(s.format_errors for s in flat) / max(turns, 1),
        mean_turns=turns / max(len(flat), 1),
        infra_faults=sum(s.infra_fault for s in flat),
        by_category={} if categories is None else by_category(per_task, categories),
        solved=[sum(s.resolved for s in t) for t in per_task],
        categories=list(categories or []),
        compaction=compaction_figures(flat) if any(s.compactions for s in flat) else {},
        terminations=dict(sorted(Counter(s.termination for s in flat).items())),
    )
