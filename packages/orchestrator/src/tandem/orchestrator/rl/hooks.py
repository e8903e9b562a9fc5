"""Observers of an RL run, for tests and tools."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem.orchestrator.protocols import State
from tandem.orchestrator.wire import Group, Sample

StepCallback = Callable[[int, dict[str, Any]], Any]
"""Called with (step, metrics) after each step; a returned awaitable is awaited before the
next step."""


@dataclass
class RunHooks:
    """Called with (version, weights) on the trainer side after each publish and on the
    engine side after each applied pull (local engines only), with (step, metrics) after
    each step, and with each group as it is formed; and which signals stop the run."""

    on_publish: Callable[[int, State], None] | None = None
    on_engine_update: Callable[[int, State], None] | None = None
    on_step: StepCallback | None = None
    on_group: Callable[[Group], None] | None = None
    reward: Callable[[Sample], float] | None = None
    """Replaces the environment's reward (wiring tests use it to get non-constant groups)."""
    stop_signals: tuple[int, ...] = ()
    """Signals that stop the run cleanly (the command line passes SIGINT and SIGTERM): a step
    in training finishes, one still waiting for groups is abandoned, a checkpoint of the
    last finished step is written and the run returns; the same signal again quits at once."""
    on_stop: Callable[[int, int], None] | None = None
    """Called with (signal, steps done) when one of ``stop_signals`` ended the run."""
