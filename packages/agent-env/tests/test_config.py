"""Config validation: nonsense values are refused with the field's name and path."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from tandem.agent_env import EnvConfig, SandboxConfig, SandboxLimits

LIMITS = "sandbox.limits"
BAD = [
    ("", "max_turns", 0),
    ("", "episode_wall_s", 0),
    ("", "grade_timeout_s", -1.0),
    ("sandbox", "python", ""),
    ("sandbox", "python", "python3"),
    ("sandbox", "shell", "bin/bash"),
    (LIMITS, "output_head_chars", -1),
    (LIMITS, "output_tail_chars", -1),
    (LIMITS, "command_timeout_s", float("nan")),
    *[(LIMITS, f, 0) for f in SandboxLimits.__struct_fields__ if not f.startswith("output_")],
]


@pytest.mark.parametrize(("where", "field", "value"), BAD)
def test_a_bad_value_names_its_field_and_path(where: str, field: str, value: Any) -> None:
    raw: dict[str, Any] = {field: value}
    for key in reversed(where.split(".") if where else []):
        raw = {key: raw}
    with pytest.raises(msgspec.ValidationError) as err:
        msgspec.convert(raw, EnvConfig)
    text = str(err.value)
    assert text.startswith(f"{field} must be "), text
    if where:  # msgspec appends the struct's path (none for the top level)
        assert text.endswith(f" - at `$.{where}`"), text
    else:
        assert " - at `" not in text, text


def test_defaults_and_edge_values_are_accepted() -> None:
    assert msgspec.convert({}, EnvConfig) == EnvConfig()
    raw = {
        "max_turns": 1,
        "sandbox": {"limits": {"output_head_chars": 0, "output_tail_chars": 0, "pids": 1}},
    }
    cfg = msgspec.convert(raw, EnvConfig)
    assert cfg.sandbox.limits.output_head_chars == 0 and cfg.max_turns == 1


def test_direct_construction_raises_value_error() -> None:
    with pytest.raises(ValueError, match=r"pids must be > 0, got 0"):
        SandboxLimits(pids=0)
    with pytest.raises(ValueError, match="shell must be a non-empty absolute path"):
        SandboxConfig(shell="")
    with pytest.raises(ValueError, match=r"max_turns must be >= 1"):
        EnvConfig(max_turns=0)
