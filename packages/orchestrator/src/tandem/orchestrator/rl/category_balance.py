"""Category-balanced advantages: a falling task category's groups weigh more.

A policy that cannot yet tell a function's bug kinds apart gains most, under the plain
GRPO objective (the mean reward), by sending every task of the function the fix that pays
most often: one category rises while its siblings fall to zero (docs/experiments.md). The
sum over categories of log(pass rate) has no such corner: its gradient is each category's
gradient divided by that category's pass rate, so a category that starts to fall weighs
more in every step until it stops falling. Here each group's training rewards are scaled
by its category's weight (Dr. GRPO's advantages, reward minus the group mean, scale with
them; the equal-reward filter does not see the scale):

    weight(c) = clamp(mean over seen categories of R / max(R_c, floor), 1 / cap, cap)

with R_c a running mean (an exponential moving average over its groups, ``ema`` the new
group's share) of category c's environment rewards. Rewards are meant to be pass rates in
[0, 1]; a category whose mean is at or below ``floor`` counts as ``floor``. The running means
are part of a run's checkpoint (`state`, `load`): a resumed run weighs its next groups as
the uninterrupted run would have.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.orchestrator.config import CategoryBalanceConfig


class CategoryBalance:
    """Running category rewards and the weight of the next group of each category."""

    def __init__(self, config: CategoryBalanceConfig) -> None:
        self.config = config
        self._mean: dict[str, float] = {}

    def weight(self, category: str, rewards: Sequence[float]) -> float:
        """Record one finished group's (environment) rewards; its training weight."""
        mean = sum(rewards) / len(rewards)
        seen = self._mean.get(category)
        a = self.config.ema
        self._mean[category] = mean if seen is None else (1 - a) * seen + a * mean
        return self._weight(category)

    def _weight(self, category: str) -> float:
        c = self.config
        average = sum(self._mean.values()) / len(self._mean)
        ratio = average / max(self._mean[category], c.floor)
        return min(c.cap, max(1 / c.cap, ratio))

    def state(self) -> dict[str, float]:
        """The running mean reward of every category seen, for a checkpoint."""
        return dict(self._mean)

    def load(self, state: dict[str, float]) -> None:
        """Continue from a checkpoint's `state`."""
        bad = {k: v for k, v in state.items() if not isinstance(v, (int, float))}
        if bad:
            raise ValueError(f"category balance state: running means must be numbers, got {bad}")
        self._mean = {str(k): float(v) for k, v in state.items()}

    def weights(self) -> dict[str, float]:
        """Every seen category's weight now, for the step's line."""
        return {category: round(self._weight(category), 3) for category in sorted(self._mean)}
