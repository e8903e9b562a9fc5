"""Lowering a process's CPU priority (its nice value), every thread of it.

When trainer ranks and rollout engines share a machine's cores, both run flat out in async
mode, yet only one of them sets the pace: the engines (the trainer waits for their groups part
of the time). At equal priority the kernel gives the trainer its share of every contended
core and the engines decode slower than they could. A trainer rank with a higher nice value
leaves the engines the CPU first and uses what is left, which is enough while it has time to
spare. (On a 2-core machine, async GRPO with one engine actor and one trainer rank, both at
Ray's default nice 15: the trainer at 19 gave 9.6% and 10.9% more trajectories/s, in two
pairs of 90 s runs.)

Linux keeps a nice value per thread (``setpriority`` on a process id changes only its main
thread), so `set_nice` sets every thread of the process; threads started later inherit the
value of the thread that starts them.

`run_when_idle` goes further, for work that should cost another job no time at all (an
evaluation beside RL): Linux's SCHED_IDLE policy, whose threads run only on a core that
nothing else wants.
"""

from __future__ import annotations

import os
import sys

import structlog

log = structlog.get_logger()

MAX_NICE = 19


def _threads() -> list[int]:
    """This process's thread ids (Linux), or [0] (the calling process) elsewhere."""
    if sys.platform.startswith("linux"):
        return [int(t) for t in os.listdir("/proc/self/task")]
    return [0]


def set_nice(value: int) -> int:
    """Give every thread of this process the nice value ``value`` (0-19); returns the value
    the process holds after the call.

    It only ever lowers the priority: a ``value`` below the current one (a higher priority,
    which needs privileges) is not applied; the current value is kept and logged."""
    if not 0 <= value <= MAX_NICE:
        raise ValueError(f"set_nice: value must be in 0..{MAX_NICE}, got {value}")
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if value < current:
        log.warning(
            "priority.kept",
            asked=value,
            kept=current,
            reason="a process may only lower its own priority (raise its nice value)",
        )
        return current
    for tid in _threads():
        try:
            os.setpriority(os.PRIO_PROCESS, tid, value)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
    log.debug("priority.set", nice=value)
    return value


def run_when_idle() -> str:
    """Put every thread of this process (and what it starts later: threads and child
    processes inherit it) in Linux's SCHED_IDLE policy; elsewhere, or where the policy is
    refused, nice 19. Returns which.

    Nice 19 still takes a share of a contended core: an evaluation at nice 19 beside the
    demo's RL made RL 9.5% slower (276 s against 252 s), one under SCHED_IDLE did not (248 s);
    they ended 10 s and 31 s after RL."""
    if not hasattr(os, "SCHED_IDLE"):
        set_nice(MAX_NICE)
        return "nice 19"
    for tid in _threads():
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except PermissionError:  # a sandbox that filters the call
            set_nice(MAX_NICE)
            return "nice 19"
    log.debug("priority.set", policy="SCHED_IDLE")
    return "SCHED_IDLE"
