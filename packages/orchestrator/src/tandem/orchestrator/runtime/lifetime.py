"""Worker processes that end when the process that started them does.

A spawned worker (an evaluation replica) outlives a parent that is killed: `daemon=True`
acts only when the parent exits normally. Left alone it would play its tasks to the end and
then wait forever to send them through a pipe that nobody reads, holding its copy of the
policy. On Linux the kernel kills it with its parent (``PR_SET_PDEATHSIG``, which fires when
the *thread* that started it exits, so a caller must wait for its workers in that thread);
elsewhere a watchdog thread polls the parent's id.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
POLL_S = 1.0
"""How often the watchdog (where the kernel cannot be asked) checks for the parent."""


def end_with_parent(parent_pid: int) -> None:
    """End this process when ``parent_pid``, its parent, ends (or has already ended)."""
    if sys.platform.startswith("linux") and _kill_on_parent_death():
        if os.getppid() != parent_pid:  # the parent died before the request took effect
            os._exit(1)
        return
    threading.Thread(
        target=_watch, args=(parent_pid,), name="tandem-parent-watch", daemon=True
    ).start()


def _kill_on_parent_death() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _watch(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(POLL_S)
    os._exit(1)
