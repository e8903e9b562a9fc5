"""Groups for the trainer: played through the rollouts from the task cursor, then checked.

Every schedule gets its groups here. A group whose episodes were cut or whose sandbox failed
is dropped whole (nothing partial reaches the trainer); so is one an infrastructure fault
touched, since its rewards say nothing about the policy. The reward hook, when set, replaces
the environment's reward; ``tool_error_penalty`` then charges each failed call, after the
category rewards are recorded (they stay the environment's), and ``balance`` then scales the
group's training rewards by its category's weight (`CategoryBalance`). The counters are the
run's, and so is the reward of each task category over every group played
(`CategoryRewards`, equal-reward groups included).
"""

from __future__ import annotations

import asyncio

import structlog

from tandem.orchestrator.protocols import Rollouts, TaskCursor, WorkerLost
from tandem.orchestrator.rl.category_balance import CategoryBalance
from tandem.orchestrator.rl.category_rewards import CategoryRewards
from tandem.orchestrator.rl.hooks import RunHooks
from tandem.orchestrator.rl.signal import SignalFilter
from tandem.orchestrator.rl.staleness import group_version
from tandem.orchestrator.wire import Group

log = structlog.get_logger()


class GroupSource:
    """Plays groups and keeps the run's counts of them."""

    def __init__(
        self,
        rollouts: Rollouts,
        cursor: TaskCursor,
        hooks: RunHooks,
        train_failed: bool = False,
        tool_error_penalty: float = 0.0,
        balance: CategoryBalance | None = None,
    ) -> None:
        self.rollouts = rollouts
        self.cursor = cursor
        self.hooks = hooks
        self.signal = SignalFilter(train_failed)
        self.tool_error_penalty = tool_error_penalty
        self.balance = balance
        self.categories = CategoryRewards()
        self.trajectories = 0
        self.requeued = 0
        self.episodes_cut = 0
        self.playing = 0  # groups being played now

    @property
    def idle(self) -> bool:
        """No group is being played: the engines have nothing to do."""
        return self.playing == 0

    async def play(self, index: int, min_version: int = -1) -> Group | None:
        """Task ``index``'s group, or None when it had to be dropped; raises `WorkerLost`
        when its worker is gone (the caller plays it again)."""
        self.playing += 1
        try:
            played = await self.rollouts.play(index, min_version)
        finally:
            self.playing -= 1
        task_id = self.cursor.task(index).id
        if played.dropped:
            self.episodes_cut += played.cut
            log.warning("rl.group_dropped", reason=played.dropped, task=task_id)
            return None
        samples = played.samples
        self.trajectories += len(samples)
        if self.hooks.reward is not None:
            for s in samples:
                s.reward = float(self.hooks.reward(s))
        if any(s.infra_fault for s in samples):
            log.warning("rl.group_dropped", reason="infrastructure fault", task=task_id)
            return None
        category, rewards = self.cursor.category(index), [s.reward for s in samples]
        self.categories.record(category, rewards)
        weight = 1.0 if self.balance is None else self.balance.weight(category, rewards)
        for s in samples:
            s.reward = weight * (s.reward - self.tool_error_penalty * s.tool_errors)
        group = Group(samples=list(samples), policy_version=group_version(samples))
        if self.hooks.on_group is not None:
            self.hooks.on_group(group)
        return group

    def lost(self, index: int, error: WorkerLost) -> None:
        log.warning("rl.group_requeued", index=index, reason=str(error))
        self.requeued += 1

    async def play_to_the_end(self, index: int) -> Group | None:
        """`play`, again at once while the worker is lost (same index, same weights, so the
        same samples)."""
        while True:
            try:
                return await self.play(index)
            except WorkerLost as e:
                self.lost(index, e)

    async def play_step(self, groups_per_step: int) -> list[Group]:
        """One step's informative groups, played from the task cursor on the engines'
        current weights (sync and pipelined: a group's place in the run fixes its samples)."""
        groups: list[Group] = []
        while len(groups) < groups_per_step:
            indices = [self.cursor.next_index() for _ in range(groups_per_step - len(groups))]
            played = await asyncio.gather(*(self.play_to_the_end(i) for i in indices))
            for index, group in zip(indices, played, strict=True):  # recorded in task order
                if group is not None:
                    self.cursor.record(index, [s.reward for s in group.samples])
            groups += [g for g in played if g is not None and self.signal.informative(g)]
        return groups
