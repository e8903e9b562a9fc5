"""The error a bad config value raises, and the check that raises it (shared by the config
sections, wherever their Structs live)."""

from __future__ import annotations

from tandem.agent_env.tools import READ_ONLY_TOOLS


class ConfigValueError(ValueError):
    """A config value is out of range; the message names the field and the allowed values."""


def require(ok: bool, field: str, why: str) -> None:
    """Raise `ConfigValueError` naming ``field`` unless ``ok``."""
    if not ok:
        raise ConfigValueError(f"{field}: {why}")


def require_read_only(tools: list[str], field: str) -> None:
    """Raise `ConfigValueError` naming ``field`` if ``tools`` names one that is not read-only."""
    bad = sorted(set(tools) - READ_ONLY_TOOLS)
    require(not bad, field, f"{bad} change the workspace; only {sorted(READ_ONLY_TOOLS)} can")
