"""The one exception type of tandem-grpo."""

from __future__ import annotations


class GRPOError(ValueError):
    """Bad input to a tandem-grpo function: the message says what was wrong and what to do.

    A subclass of ValueError so callers that already guard configuration and shape errors
    with ``except ValueError`` keep working.
    """
