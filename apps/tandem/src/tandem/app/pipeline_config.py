"""Config of the pipeline commands (`demo`, `midtrain`, `train`, `eval`): plain data, no torch.

One type serves all four commands so one TOML file describes a whole run; each command reads
the sections it needs. The sections are the orchestrator's own config Structs.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from tandem.app.config import AppConfig
from tandem.orchestrator.config import (
    EngineConfig,
    EnvSettings,
    MidtrainConfig,
    ModelConfig,
    RLConfig,
    TaskConfig,
    TrainerConfig,
)


class EvalSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Held-out evaluation: ``tasks`` tasks of ``tasks.eval_seed``, ``samples`` each, pass@k."""

    tasks: int = 32
    samples: int = 1
    ks: list[int] = msgspec.field(default_factory=lambda: [1])

    def __post_init__(self) -> None:
        if self.tasks < 1 or self.samples < 1:
            raise ValueError("tasks and samples must be >= 1")
        if not self.ks or min(self.ks) < 1 or max(self.ks) > self.samples:
            raise ValueError(f"ks must be in [1, samples={self.samples}]")


class DemoSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The demo's wall-clock plan: mid-training gets at most ``midtrain_budget_s``; RL gets
    what is left of ``time_budget_s`` after reserving time for the final evaluation."""

    time_budget_s: float = 780.0
    midtrain_budget_s: float = 360.0

    def __post_init__(self) -> None:
        if self.time_budget_s <= 0 or self.midtrain_budget_s <= 0:
            raise ValueError("budgets must be > 0 seconds")


class PipelineConfig(AppConfig):
    """Everything a run needs; ``policy`` points `train`/`eval` at a saved policy directory
    (default: the run's ``midtrained/``)."""

    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    tasks: TaskConfig = msgspec.field(default_factory=TaskConfig)
    env: EnvSettings = msgspec.field(default_factory=EnvSettings)
    midtrain: MidtrainConfig = msgspec.field(default_factory=MidtrainConfig)
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    rl: RLConfig = msgspec.field(default_factory=RLConfig)
    eval: EvalSettings = msgspec.field(default_factory=EvalSettings)
    demo: DemoSettings = msgspec.field(default_factory=DemoSettings)
    policy: str = ""

    @property
    def run_dir(self) -> Path:
        return Path(self.run.output_dir) / self.run.name
