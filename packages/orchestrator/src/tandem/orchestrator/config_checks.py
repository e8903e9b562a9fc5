"""The error a bad config value raises, and the check that raises it (shared by the config
sections, wherever their Structs live)."""

from __future__ import annotations


class ConfigValueError(ValueError):
    """A config value is out of range; the message names the field and the allowed values."""


def require(ok: bool, field: str, why: str) -> None:
    """Raise `ConfigValueError` naming ``field`` unless ``ok``."""
    if not ok:
        raise ConfigValueError(f"{field}: {why}")


READ_ONLY_TOOLS = frozenset({"list_dir", "read_file", "run_tests", "search"})
"""agent-env's tools that change nothing in the workspace: an episode without its calls to
them gives every other observation unchanged."""


def require_read_only(tools: list[str], field: str) -> None:
    bad = sorted(set(tools) - READ_ONLY_TOOLS)
    require(not bad, field, f"{bad} change the workspace; only {sorted(READ_ONLY_TOOLS)} can")
