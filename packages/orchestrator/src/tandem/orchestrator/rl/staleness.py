"""The staleness-bounded buffer between rollout workers and the trainer.

Rollout workers put complete groups (all samples of one prompt, as GRPO needs them) tagged
with the oldest policy version that produced any of their tokens. The trainer takes groups
for its current version; a group whose version is more than ``max_staleness`` behind is
dropped and counted, never trained on. ``capacity`` bounds how far rollouts can run ahead
of the trainer: producers wait when it is full, which is what keeps staleness bounded in
steady state instead of merely filtered.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Group(Generic[T]):
    """The samples of one prompt and the oldest policy version among their tokens."""

    samples: Sequence[T]
    policy_version: int


@dataclass
class BufferStats:
    """Counters the run reports: what was accepted, used and dropped, and at what staleness."""

    put: int = 0
    taken: int = 0
    dropped_stale: int = 0
    staleness_histogram: dict[int, int] = field(default_factory=dict)

    @property
    def dropped_fraction(self) -> float:
        seen = self.taken + self.dropped_stale
        return self.dropped_stale / seen if seen else 0.0


class StalenessBuffer(Generic[T]):
    """FIFO of groups with a staleness bound and a capacity (in groups)."""

    def __init__(self, max_staleness: int, capacity: int) -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 group, got {capacity}")
        self.max_staleness = max_staleness
        self.capacity = capacity
        self.stats = BufferStats()
        self._groups: deque[Group[T]] = deque()
        self._cond = asyncio.Condition()
        self._closed = False

    def __len__(self) -> int:
        return len(self._groups)

    async def put(self, group: Group[T]) -> None:
        """Add a complete group, waiting while the buffer is full."""
        async with self._cond:
            await self._cond.wait_for(lambda: self._closed or len(self._groups) < self.capacity)
            if self._closed:
                raise RuntimeError("buffer is closed")
            self._groups.append(group)
            self.stats.put += 1
            self._cond.notify_all()

    def _drop_stale(self, trainer_version: int) -> None:
        kept = deque(
            g for g in self._groups if trainer_version - g.policy_version <= self.max_staleness
        )
        self.stats.dropped_stale += len(self._groups) - len(kept)
        self._groups = kept

    async def take(self, n_groups: int, trainer_version: int) -> list[Group[T]]:
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
            for g in out:
                age = trainer_version - g.policy_version
                self.stats.staleness_histogram[age] = self.stats.staleness_histogram.get(age, 0) + 1
            self.stats.taken += n_groups
            self._cond.notify_all()
            return out

    async def close(self) -> None:
        """Wake every waiter; later puts raise and takes return what is left or raise."""
        async with self._cond:
            self._closed = True
            self._cond.notify_all()
