"""Which generated tasks a run draws: the family, its settings and the two seeds."""

from __future__ import annotations

from typing import Literal

import msgspec

from tandem.agent_env import SandboxError, check_multibug_family, check_task_family
from tandem.orchestrator.config_checks import ConfigValueError
from tandem.orchestrator.config_checks import require as _require


class TaskConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Which generated tasks are used; training and held-out sets are different seeds.

    ``family``: ``single``, one bug in a one-module repository (agent-env's
    `generate_tasks`), or ``multibug``, the long-horizon family (`generate_multibug_tasks`):
    ``repo_modules`` modules of ``functions_per_repo`` functions each, ``buggy_modules`` of
    them with one bug; grade it with ``env.partial_credit`` (the fraction of hidden tests
    that pass). ``functions`` and ``modules`` narrow the ``single`` family only.
    """

    family: Literal["single", "multibug"] = "single"
    repo_modules: int = 6
    buggy_modules: int = 4
    train_seed: int = 1
    eval_seed: int = 1000
    kinds: list[str] = msgspec.field(
        default_factory=lambda: [
            "wrong_operator", "off_by_one", "wrong_constant",
            "swapped_arguments", "wrong_variable", "wrong_return",
        ]
    )  # fmt: skip
    functions_per_repo: int = 1
    hidden_per_function: int = 6
    functions: list[str] = msgspec.field(default_factory=list)
    """Template functions the bugs are drawn from (empty: all of agent-env's)."""
    modules: list[str] = msgspec.field(default_factory=list)
    """Module names the repositories use (empty: all of agent-env's)."""
    rename_locals: bool = False
    """Each task's functions get parameters and locals of their own (agent-env's
    `generate_tasks`), so a fix cannot be recalled from other tasks, only copied from the
    file (``single`` family only)."""

    def __post_init__(self) -> None:
        _require(self.train_seed != self.eval_seed, "eval_seed", "must differ from train_seed")
        if self.family == "multibug":
            for name in ("functions", "modules"):
                _require(not getattr(self, name), name, "narrows the single family only (empty)")
            _require(not self.rename_locals, "rename_locals", "applies to the single family only")
            try:
                check_multibug_family(
                    self.repo_modules,
                    self.buggy_modules,
                    self.functions_per_repo,
                    self.kinds,
                    self.hidden_per_function,
                )
            except ValueError as e:
                raise ConfigValueError(_multibug_field(str(e))) from None
            return
        try:
            check_task_family(self.kinds, self.functions_per_repo, self.functions, self.modules)
        except SandboxError as e:
            raise ConfigValueError(str(e)) from None


def _multibug_field(message: str) -> str:
    """agent-env's message with its argument named as this config's field."""
    names = {
        "modules": "repo_modules",
        "buggy": "buggy_modules",
        "functions_per_module": "functions_per_repo",
    }
    head, _, rest = message.partition(":")
    return f"{names.get(head, head)}:{rest}"
