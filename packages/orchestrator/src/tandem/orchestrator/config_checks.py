"""The error a bad config value raises, and the check that raises it (shared by the config
sections, wherever their Structs live)."""

from __future__ import annotations


class ConfigValueError(ValueError):
    """A config value is out of range; the message names the field and the allowed values."""


def require(ok: bool, field: str, why: str) -> None:
    """Raise `ConfigValueError` naming ``field`` unless ``ok``."""
    if not ok:
        raise ConfigValueError(f"{field}: {why}")
