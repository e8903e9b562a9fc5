"""An `Engine` for episode tests: each turn is the next of the given sampled turns, so a test
knows every token an episode holds (log-probs, versions and experts are placeholders)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from tandem.orchestrator.wire import TurnOutput


class ReplayEngine:
    """The `Engine` protocol answering each turn with the next of ``turns``; ``feeds``
    records what each turn was fed."""

    def __init__(self, turns: list[list[int]], max_len: int = 8192) -> None:
        self.turns = list(turns)
        self.feeds: list[list[int]] = []
        self._max_len = max_len

    @property
    def max_len(self) -> int:
        return self._max_len

    async def acquire(self) -> int:
        return 0

    def release(self, slot: int) -> None:
        pass

    async def generate(
        self,
        slot: int,
        feed: list[int],
        generator: torch.Generator,
        max_new_tokens: int,
        keep_going: Callable[[int], bool] | None = None,
    ) -> TurnOutput:
        self.feeds.append(list(feed))
        tokens = self.turns.pop(0)
        fed = len(feed) + len(tokens) - 1  # every sampled token but the last is fed
        return TurnOutput(
            tokens=tokens,
            logprobs=[-0.5] * len(tokens),
            versions=[0] * len(tokens),
            routes=np.zeros((fed, 1, 1), dtype=np.int16),
            min_version=0,
            max_version=0,
            truncated=False,
        )
