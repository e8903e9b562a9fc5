"""The config of every `tandem` command: the orchestrator's run config plus the app's own.

One type serves all commands so one TOML file describes a whole run; each command reads the
sections it needs. The stage sections are `tandem.orchestrator.RunConfig`'s (with the
libraries' configs nested as they are); ``logging`` and ``demo`` are the app's.
"""

from __future__ import annotations

import msgspec

from tandem.app.config import LoggingConfig
from tandem.orchestrator import RunConfig


class DemoSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The demo's wall-clock plan: mid-training gets at most ``midtrain_budget_s``; RL gets
    what is left of ``time_budget_s`` after reserving time for the final evaluation."""

    time_budget_s: float = 780.0
    midtrain_budget_s: float = 360.0

    def __post_init__(self) -> None:
        if self.time_budget_s <= 0 or self.midtrain_budget_s <= 0:
            raise ValueError("budgets must be > 0 seconds")


class PipelineConfig(RunConfig):
    """Everything a `tandem` command reads."""

    logging: LoggingConfig = msgspec.field(default_factory=LoggingConfig)
    demo: DemoSettings = msgspec.field(default_factory=DemoSettings)
