"""The training reward of each task category, step by step.

A small policy can gain a whole category (a function and bug kind) while it loses another
that shares the same first tool calls, and the batch's mean reward hides it: one rises as
the other falls. Every finished group is counted here, the ones the trainer filters out as
equal-reward too (a category the policy has lost entirely gives only such groups), so the
per-step table shows a category's collapse as it happens, not only in the final evaluation.
"""

from __future__ import annotations

from collections.abc import Sequence


class CategoryRewards:
    """Mean reward and group count per category, since the last `take` and over the run."""

    def __init__(self) -> None:
        self._step: dict[str, list[float]] = {}
        self._run: dict[str, list[float]] = {}

    def record(self, category: str, rewards: Sequence[float]) -> None:
        """One finished group of a task of ``category`` with these samples' rewards."""
        if not rewards:
            return
        for table in (self._step, self._run):
            row = table.setdefault(category, [0.0, 0.0, 0.0])  # groups, reward sum, samples
            row[0] += 1
            row[1] += float(sum(rewards))
            row[2] += len(rewards)

    @staticmethod
    def _rows(table: dict[str, list[float]]) -> dict[str, dict[str, float]]:
        return {
            category: {"groups": int(groups), "reward": round(total / samples, 4)}
            for category, (groups, total, samples) in sorted(table.items())
        }

    def take(self) -> dict[str, dict[str, float]]:
        """The groups finished since the previous call, per category (then forgotten)."""
        rows = self._rows(self._step)
        self._step = {}
        return rows

    def totals(self) -> dict[str, dict[str, float]]:
        """Every group of the run so far, per category."""
        return self._rows(self._run)
