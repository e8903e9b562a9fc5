"""The config of every `tandem` command: the orchestrator's run config plus the app's own.

One type serves all commands so one TOML file describes a whole run; each command reads the
sections it needs. The stage sections are `tandem.orchestrator.RunConfig`'s (with the
libraries' configs nested as they are); ``logging`` and ``demo`` are the app's.
"""

from __future__ import annotations

import msgspec

from tandem.app.config import LoggingConfig
from tandem.orchestrator import RunConfig

VARIANTS = ("none", "sliding", "prompted", "trained")
"""The long-horizon comparison's variants (`tandem.app.compare`)."""


class CompareSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``[demo.compare]``: the variants to compare (empty: the demo runs one pipeline) and
    the RL seeds of the summary variants (``prompted``, ``trained``); the others run the
    run's seed once."""

    variants: list[str] = []
    seeds: int = 3

    def __post_init__(self) -> None:
        bad = [v for v in self.variants if v not in VARIANTS]
        if bad:
            raise ValueError(f"variants: unknown {bad}; choose from {list(VARIANTS)}")
        if self.seeds < 1:
            raise ValueError("seeds: must be >= 1")


class DemoSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The demo's own settings. Its work is fixed by the stage sections (``midtrain.steps``,
    ``rl.steps``, ``eval.tasks`` x ``eval.samples``), so the same config and seed learn the
    same on any machine and the wall time is a result.

    ``time_cap_s``: 0 (none) or the seconds the whole demo may take: RL stops early enough to
    leave the final evaluation as long as the first took, and mid-training stops at
    ``midtrain_cap_s`` (0: at ``time_cap_s``). The report's first lines say when a cap cut a
    stage short. ``lift_band``: the band of held-out pass@1 lifts (points) the README states
    for this config, which the report compares the run with. ``compare``: variants of the
    long-horizon comparison (`tandem.app.compare`) to run instead of one pipeline."""

    time_cap_s: float = 0.0
    midtrain_cap_s: float = 0.0
    lift_band: tuple[float, float] = (7.0, 18.1)
    compare: CompareSettings = msgspec.field(default_factory=CompareSettings)

    def __post_init__(self) -> None:
        if self.time_cap_s < 0 or self.midtrain_cap_s < 0:
            raise ValueError("time caps must be >= 0 seconds (0: no cap)")
        if self.lift_band[0] > self.lift_band[1]:
            raise ValueError(f"lift_band must be [low, high], got {list(self.lift_band)}")

    def midtrain_cap(self) -> float | None:
        """Seconds mid-training may take, None for no cap."""
        caps = [c for c in (self.midtrain_cap_s, self.time_cap_s) if c > 0]
        return min(caps) if caps else None


class PipelineConfig(RunConfig):
    """Everything a `tandem` command reads."""

    logging: LoggingConfig = msgspec.field(default_factory=LoggingConfig)
    demo: DemoSettings = msgspec.field(default_factory=DemoSettings)
