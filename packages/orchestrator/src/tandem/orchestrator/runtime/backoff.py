"""How long to wait between tries while the weight store fails."""

from __future__ import annotations

RETRY_S, RETRY_MAX_S = 0.5, 5.0
"""The first wait and the longest; each failed try doubles the wait up to the longest."""


def next_delay(delay: float) -> float:
    return min(2 * delay, RETRY_MAX_S)
