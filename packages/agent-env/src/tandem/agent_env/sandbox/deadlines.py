"""Many long timeouts that almost never fire, checked by one periodic timer per event loop.

Every tool call waits for its supervisor's answer with a generous timeout (the command's own
budget plus a margin) that only a hung or stopped sandbox reaches. ``asyncio.timeout`` (or
``wait_for``) arms and cancels a timer per call, which with hundreds of episodes is a heap
operation of Python-level comparisons per call on the host's busiest thread. Here a call only
records its deadline; one timer per loop, running only while something waits, expires what
is overdue. A timeout fires up to :data:`PERIOD_S` late, which is noise at these lengths.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable

PERIOD_S = 0.5


class Deadlines:
    """Deadlines of one event loop: ``add`` before waiting, ``discard`` after."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._waiting: dict[object, tuple[float, Callable[[], None]]] = {}
        self._timer: asyncio.TimerHandle | None = None

    def add(self, key: object, timeout_s: float, on_expiry: Callable[[], None]) -> None:
        """Call ``on_expiry`` once ``timeout_s`` have passed, unless ``key`` is discarded."""
        self._waiting[key] = (self._loop.time() + timeout_s, on_expiry)
        if self._timer is None:
            self._timer = self._loop.call_later(PERIOD_S, self._check)

    def discard(self, key: object) -> None:
        self._waiting.pop(key, None)

    def _check(self) -> None:
        self._timer = None
        now = self._loop.time()
        overdue = [key for key, (deadline, _) in self._waiting.items() if deadline <= now]
        for key in overdue:
            _, on_expiry = self._waiting.pop(key)
            on_expiry()
        if self._waiting:
            self._timer = self._loop.call_later(PERIOD_S, self._check)


_PER_LOOP: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Deadlines] = (
    weakref.WeakKeyDictionary()
)


def deadlines() -> Deadlines:
    """The running loop's :class:`Deadlines` (created on first use, gone with the loop)."""
    loop = asyncio.get_running_loop()
    found = _PER_LOOP.get(loop)
    if found is None:
        found = _PER_LOOP[loop] = Deadlines(loop)
    return found
