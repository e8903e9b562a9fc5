"""Stopping background tasks for sure.

On Python 3.11, ``asyncio.wait_for`` can swallow a cancellation that arrives as its inner
future completes (fixed in 3.12): the cancelled task goes on running. A Ray ObjectRef
resolves from another thread, which makes that race real for a rollout worker awaiting a
remote group, and a worker loop that never ends would hang the run's shutdown. So tasks
are cancelled again until they are done.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

RECANCEL_S = 0.5
"""How long a cancelled task gets before it is cancelled again."""


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel ``tasks`` and wait until every one is done (results and errors are dropped)."""
    tasks = list(tasks)
    pending = {t for t in tasks if not t.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_S)
    for task in tasks:
        if not task.cancelled():
            task.exception()  # retrieved: no "exception was never retrieved" warning
