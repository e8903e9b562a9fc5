"""Which groups carry a GRPO signal, and a warning when a long run of them does not.

A group whose samples all got the same reward has zero advantage everywhere: the trainer
skips it and waits for others (DAPO's dynamic sampling), so every step learns from
``groups_per_step`` informative groups. A long run of such groups means the tasks are too
hard (or too easy) for the policy; it is reported with what the rewards were. With
``trainer.loss.failed_group_advantage`` set, a group in which every sample failed (rewards 0
or below) carries a signal too: the trainer pushes the policy away from what it did there.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from tandem.orchestrator.wire import Group, has_signal

log = structlog.get_logger()

NO_SIGNAL_REPORT_EVERY = 32
"""Equal-reward groups in a row between two `rl.no_signal` warnings."""


class SignalFilter:
    """Counts the groups without signal (``filtered``) and the current run of them."""

    def __init__(self, train_failed: bool = False) -> None:
        self.train_failed = train_failed
        self.filtered = 0
        self._run = [0, 0]  # equal-reward groups in a row: [all rewarded, all unrewarded]
        self._limit = 0
        self._on_limit: Callable[[], None] | None = None

    def give_up_after(self, groups: int, on_limit: Callable[[], None]) -> None:
        """Call ``on_limit`` once ``groups`` equal-reward groups came in a row (0: never): a
        run of fixed length would otherwise wait forever on a policy with nothing to learn."""
        self._limit, self._on_limit = groups, on_limit

    def informative(self, group: Group) -> bool:
        """Whether the group's rewards differ; if not it is counted (and maybe reported)."""
        rewards = [s.reward for s in group.samples]
        run = self._run
        if has_signal(rewards, self.train_failed):
            run[:] = [0, 0]
            return True
        self.filtered += 1
        run[0 if rewards[0] > 0 else 1] += 1
        if sum(run) % NO_SIGNAL_REPORT_EVERY == 0:
            log.warning(
                "rl.no_signal",
                groups_in_a_row=sum(run),
                all_rewarded=run[0],
                all_unrewarded=run[1],
                hint="every sample of these groups got the same reward, so the trainer waits "
                "for others: tasks too hard (or too easy) for this policy, or rl.group_size "
                "too small",
            )
        if self._limit and sum(run) == self._limit and self._on_limit is not None:
            log.warning("rl.no_signal_limit", groups_in_a_row=self._limit)
            self._on_limit()
        return False
