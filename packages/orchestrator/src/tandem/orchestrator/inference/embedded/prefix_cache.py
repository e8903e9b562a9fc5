"""Prefix sharing between KV-cache slots: a turn whose tokens continue another slot's cached
tokens copies those keys and values (and their routes) instead of recomputing them.

Why it is exact: under `batch_invariant()` the keys and values of token t depend only on
tokens 0..t and the weights, not on the batch or on the slot that computes them, so copied
rows are bit for bit the rows this slot would compute, provided both slots computed them
under the same policy version. Only slots whose whole cache was filled at the current
version therefore give or take rows; a weight update ends all sharing until the cache is
refilled. The experts each copied token was routed to come along, so an episode's routing
trace still covers every token it fed.

Who benefits: the samples of a GRPO group share their whole prompt, and often their first
turns too (the same read of the same file), so all but one of them skip that prefill.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

DEFER_MIN_TOKENS = 32
"""A turn waits one step for a same-step turn to compute a prefix at least this long."""


class PrefixIndex:
    """Which tokens each slot's cache holds, at which version, with their routes.

    ``lengths`` is the KV cache's own per-slot length (a view that it updates), so the index
    never keeps a second copy of how much each slot holds.
    """

    def __init__(
        self,
        lengths: np.ndarray,
        max_len: int,
        route_shape: tuple[int, ...],
        route_dtype: np.dtype | type = np.int32,
    ) -> None:
        max_slots = lengths.shape[0]
        self.lengths = lengths
        self.tokens = np.zeros((max_slots, max_len), dtype=np.int64)
        self.versions = np.full(max_slots, -1, dtype=np.int64)  # -1: empty or mixed
        self.routes = np.zeros((max_slots, max_len, *route_shape), dtype=route_dtype)

    def reset(self, slot: int) -> None:
        """``slot`` was emptied (its cache length is 0 again)."""
        self.versions[slot] = -1

    def record(self, slot: int, fed: Sequence[int], routes: np.ndarray, version: int) -> None:
        """A forward at ``version`` has just appended ``fed`` to ``slot``'s cache."""
        end = int(self.lengths[slot])
        start = end - len(fed)
        if start == 0:
            self.versions[slot] = version
        elif self.versions[slot] != version:
            self.versions[slot] = -1
        self.tokens[slot, start:end] = fed
        self.routes[slot, start:end] = routes

    def match(self, slot: int, feed: Sequence[int], version: int) -> tuple[int, int]:
        """(donor slot, how many leading tokens of ``feed`` it holds) for a turn of ``slot``
        at ``version``; (-1, 0) when no slot can give any. The last token of ``feed`` is
        always left to compute: its logits are what the turn samples from."""
        n = int(self.lengths[slot])
        want = len(feed) - 1
        if want < 1 or (n and self.versions[slot] != version):
            return -1, 0
        donors = (self.versions == version) & (self.lengths > n)
        donors[slot] = False
        if n:
            donors &= (self.tokens[:, :n] == self.tokens[slot, :n]).all(axis=1)
        idx = np.flatnonzero(donors)
        if idx.size == 0:
            return -1, 0
        width = min(want, self.tokens.shape[1] - n)
        same = self.tokens[idx, n : n + width] == np.asarray(feed[:width], dtype=np.int64)
        run = np.where(same.all(axis=1), width, np.argmin(same, axis=1))
        run = np.minimum(run, self.lengths[idx] - n)
        best = int(np.argmax(run))
        return (int(idx[best]), int(run[best])) if run[best] > 0 else (-1, 0)

    def take(self, donor: int, slot: int, count: int) -> np.ndarray:
        """``slot``'s cache has just been extended by ``count`` rows copied from ``donor``:
        record their tokens and return their routes."""
        end = int(self.lengths[slot])
        start = end - count
        routes = self.routes[donor, start:end].copy()
        self.tokens[slot, start:end] = self.tokens[donor, start:end]
        self.routes[slot, start:end] = routes
        if start == 0:
            self.versions[slot] = self.versions[donor]
        return routes

    def shared_run(self, a: tuple[int, Sequence[int]], b: tuple[int, Sequence[int]]) -> int:
        """Leading tokens two pending turns (slot, feed) would compute alike: their feeds'
        common prefix when both slots hold the same tokens, else 0."""
        (sa, fa), (sb, fb) = a, b
        n = int(self.lengths[sa])
        if n != int(self.lengths[sb]) or not np.array_equal(
            self.tokens[sa, :n], self.tokens[sb, :n]
        ):
            return 0
        width = min(len(fa), len(fb)) - 1
        if width < 1:
            return 0
        same = np.asarray(fa[:width]) == np.asarray(fb[:width])
        return width if bool(same.all()) else int(np.argmin(same))
