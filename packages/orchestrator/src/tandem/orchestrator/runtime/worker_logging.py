"""Logging in the processes a run starts (Ray workers, evaluation replicas).

A worker process has structlog's default configuration, which prints every event: every
info line of every worker would reach the console. Workers log from the level the driver
logs at."""

from __future__ import annotations

from collections.abc import Callable

import structlog


def driver_log_level() -> int:
    """The lowest level this process logs at (0 when its structlog does not filter)."""
    bound = structlog.get_logger().bind()
    return int(getattr(bound, "get_effective_level", lambda: 0)())


def log_from(level: int) -> Callable[[], None]:
    """A worker setup hook that drops the events below ``level``."""

    def setup_worker_logging() -> None:
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(level))

    return setup_worker_logging
