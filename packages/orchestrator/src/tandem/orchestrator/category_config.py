"""Task categories (a generated task's function and bug kind) and the two RL settings that act
on them: the curriculum that passes over categories without signal, and the weights that
balance categories' rewards."""

from __future__ import annotations

import msgspec

from tandem.orchestrator.config_checks import require as _require

CATEGORY_KEYS = ("function", "bug_kind")
"""The metadata fields that name a generated task's category (its function and bug kind)."""


class CurriculumConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Passing over tasks of categories that give GRPO no signal (see `SaturationFilter`).

    A task's category is the values of its ``keys`` metadata fields (generated tasks carry
    ``function``, ``bug_kind`` and ``mutation``). A category is saturated when its last
    ``window`` groups each had one reward for every sample (all solved or all failed); only a
    ``keep`` fraction of its tasks is then played, so it is still watched as the policy
    changes. Off by default: every task at the cursor is played.
    """

    enabled: bool = False
    keys: list[str] = msgspec.field(default_factory=lambda: list(CATEGORY_KEYS))
    window: int = 3
    keep: float = 0.2

    def __post_init__(self) -> None:
        _require(len(self.keys) >= 1, "keys", "must name at least one metadata field")
        _require(self.window >= 1, "window", "must be >= 1")
        _require(0 < self.keep <= 1, "keep", "must be in (0, 1] (0 would never look again)")


class CategoryBalanceConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """`rl.category_balance` (`rl/category_balance.py`: the weights, ``cap`` the largest and
    one over the smallest, ``ema`` a group's share of the running reward, ``floor``)."""

    enabled: bool = False
    cap: float = 4.0
    ema: float = 0.2
    floor: float = 0.02

    def __post_init__(self) -> None:
        _require(self.cap >= 1, "cap", "must be >= 1 (1: every weight is 1)")
        _require(0 < self.ema <= 1, "ema", "must be in (0, 1]")
        _require(0 < self.floor <= 1, "floor", "must be in (0, 1] (rewards are pass rates)")
