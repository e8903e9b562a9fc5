"""The staleness rule: which groups the trainer may learn from, and when rollouts may start.

A group counts as produced by the oldest policy version among its tokens (`group_version`):
an episode may span several versions when engines update mid-rollout, and its oldest
tokens are the furthest from the trainer. The rule, for a trainer at version ``v``:

- a group of version ``g`` is trained on only while ``v - g <= max_staleness``; an older one
  is dropped and counted, never trained on (`StalenessBuffer.take`);
- a group starts only on an engine holding at least ``v - max_staleness`` (one started on
  older weights could only be dropped), and no group starts while the engines lag further
  behind than that (the weight store is failing);
- at most ``max_ahead`` steps' worth of groups are in flight or waiting at once: rollouts
  may run ahead of the trainer, but not so far that their groups go stale. Producers wait
  while the buffer is full (``capacity``), which keeps staleness bounded in steady state
  instead of merely filtered.

The schedule fixes the bound: ``async`` uses ``rl.max_staleness`` (and ``rl.max_ahead``,
default ``max_staleness + 1``, the bound that keeps drops rare); ``sync`` trains every group
on the version that played it (0); ``pipelined`` plays step k+1 on version k while step k
trains (exactly 1 once running).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from tandem.orchestrator.config import RLConfig
from tandem.orchestrator.wire import Group, Sample


def group_version(samples: Sequence[Sample]) -> int:
    """The version a group counts as: the oldest that produced any of its tokens."""
    return min(s.min_version for s in samples)


@dataclass(frozen=True)
class StalenessRule:
    """The bound of one run (see the module doc)."""

    max_staleness: int
    max_ahead: int
    """Steps' worth of groups that may be in flight or waiting at once."""

    @classmethod
    def for_run(cls, rl: RLConfig) -> StalenessRule:
        if rl.mode == "sync":
            return cls(max_staleness=0, max_ahead=1)
        if rl.mode == "pipelined":
            return cls(max_staleness=1, max_ahead=1)
        return cls(max_staleness=rl.max_staleness, max_ahead=rl.max_ahead or rl.max_staleness + 1)

    def fresh(self, trainer_version: int, group: Group) -> bool:
        """Whether the trainer at ``trainer_version`` may train on ``group``."""
        return trainer_version - group.policy_version <= self.max_staleness

    def min_engine_version(self, trainer_version: int) -> int:
        """The oldest weights a new group may be played with."""
        return trainer_version - self.max_staleness

    def may_start(
        self, in_flight: int, groups_per_step: int, engine_version: int, trainer_version: int
    ) -> bool:
        """Whether a rollout worker may start one more group now (``in_flight``: groups
        started and not yet trained on or dropped)."""
        return (
            in_flight < self.max_ahead * groups_per_step
            and engine_version >= self.min_engine_version(trainer_version)
        )


@dataclass
class StalenessStats:
    """What the run reports: groups taken and dropped, and how stale the taken ones were."""

    put: int = 0
    taken: int = 0
    dropped_stale: int = 0
    staleness_histogram: dict[int, int] = field(default_factory=dict)

    @property
    def dropped_fraction(self) -> float:
        seen = self.taken + self.dropped_stale
        return self.dropped_stale / seen if seen else 0.0

    def count_taken(self, trainer_version: int, groups: Sequence[Group]) -> None:
        for g in groups:
            lag = trainer_version - g.policy_version
            self.staleness_histogram[lag] = self.staleness_histogram.get(lag, 0) + 1
        self.taken += len(groups)


class StalenessBuffer:
    """FIFO of complete groups between rollout workers and the trainer, dropping the ones
    the rule makes stale, with a capacity (in groups) that makes producers wait."""

    def __init__(self, rule: StalenessRule, capacity: int, stats: StalenessStats) -> None:
        if rule.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {rule.max_staleness}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 group, got {capacity}")
        self.rule = rule
        self.capacity = capacity
        self.stats = stats
        self._groups: deque[Group] = deque()
        self._cond = asyncio.Condition()
        self._closed = False

    def __len__(self) -> int:
        return len(self._groups)

    async def put(self, group: Group) -> None:
        """Add a complete group, waiting while the buffer is full."""
        async with self._cond:
            await self._cond.wait_for(lambda: self._closed or len(self._groups) < self.capacity)
            if self._closed:
                raise RuntimeError("buffer is closed")
            self._groups.append(group)
            self.stats.put += 1
            self._cond.notify_all()

    def _drop_stale(self, trainer_version: int) -> None:
        kept = deque(g for g in self._groups if self.rule.fresh(trainer_version, g))
        self.stats.dropped_stale += len(self._groups) - len(kept)
        self._groups = kept

    async def take(self, n_groups: int, trainer_version: int) -> list[Group]:
        """Wait for ``n_groups`` fresh-enough groups (oldest first) for ``trainer_version``."""
        if n_groups < 1:
            raise ValueError(f"n_groups must be >= 1, got {n_groups}")
        async with self._cond:
            while True:
                self._drop_stale(trainer_version)
                if len(self._groups) >= n_groups or self._closed:
                    break
                self._cond.notify_all()  # dropping may have made room for producers
                await self._cond.wait()
            if len(self._groups) < n_groups:
                raise RuntimeError("buffer closed before enough groups arrived")
            out = [self._groups.popleft() for _ in range(n_groups)]
            self.stats.count_taken(trainer_version, out)
            self._cond.notify_all()
            return out

    async def close(self) -> None:
        """Wake every waiter; later puts raise and takes return what is left or raise."""
        async with self._cond:
            self._closed = True
            self._cond.notify_all()
