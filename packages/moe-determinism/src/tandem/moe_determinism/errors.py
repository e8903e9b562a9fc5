"""The one exception type of tandem-moe-determinism."""

from __future__ import annotations


class MoEDeterminismError(ValueError):
    """Raised for misuse: bad shapes, a routing trace that does not fit, a trace reused, a
    config value out of range (a ValueError, so config loaders report it with the field).

    Messages say what was wrong and what to do about it, so callers never have to read a
    traceback from deep inside a kernel.
    """
