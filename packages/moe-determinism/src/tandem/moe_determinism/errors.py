"""The one exception type of tandem-moe-determinism."""

from __future__ import annotations


class MoEDeterminismError(Exception):
    """Raised for misuse: bad shapes, a routing trace that does not fit, a trace reused.

    Messages say what was wrong and what to do about it, so callers never have to read a
    traceback from deep inside a kernel.
    """
