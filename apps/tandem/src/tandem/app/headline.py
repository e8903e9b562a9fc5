"""The demo's headline: the pass@1 lift with its paired interval, how it compares with the
README's band, and whether a time cap cut a stage short.

The lift is paired by task (both evaluations play the same held-out tasks with the same
sampling seeds): a task's difference is its pass@1 after minus before, and the interval is
the normal one over tasks, mean +- 1.96 standard errors. Pairing removes what the tasks
share, so the interval is much narrower than one from two separate means.
"""

from __future__ import annotations

import msgspec

from tandem.orchestrator import EvalResult, paired_difference

Z95 = 1.96


class Lift(msgspec.Struct, frozen=True):
    """pass@1 before and after, and the paired change in points with its 95% interval
    (``low``, ``high``) and standard error ``se``."""

    tasks: int
    samples: int
    before: float
    after: float
    points: float
    low: float
    high: float
    se: float


def paired_lift(before: EvalResult, after: EvalResult) -> Lift:
    """The change from ``before`` to ``after`` (same tasks, same order), in points."""
    d = paired_difference([after], [before])
    return Lift(
        tasks=d.tasks,
        samples=before.samples_per_task,
        before=before.pass_at.get(1, 0.0),
        after=after.pass_at.get(1, 0.0),
        points=100 * d.mean,
        low=100 * d.low,
        high=100 * d.high,
        se=100 * (d.high - d.mean) / Z95,
    )


def lift_line(lift: Lift) -> str:
    return (
        f"{lift.points:+.1f} points, 95% interval {lift.low:+.1f} to {lift.high:+.1f} "
        f"(standard error {lift.se:.1f}; {lift.tasks} tasks x {lift.samples} samples)"
    )


def band_line(lift: Lift, band: tuple[float, float]) -> str:
    """Where the lift falls against the README's band ``(low, high)`` in points, said plainly
    when it falls outside."""
    low, high = band
    stated = f"the README's band, {low:+.1f} to {high:+.1f} points"
    if lift.points < low:
        return f"OUTSIDE {stated}: {low - lift.points:.1f} points below it"
    if lift.points > high:
        return f"OUTSIDE {stated}: {lift.points - high:.1f} points above it"
    return f"within {stated}"


def cut_short_line(
    stage: str, done: int, planned: int, cap_s: float | None, cap_key: str
) -> str | None:
    """None when ``stage`` ran its ``planned`` steps; else what stopped it: the time cap
    (``cap_s`` seconds, set by ``cap_key``), or, with no cap, an early end the log explains."""
    if done >= planned:
        return None
    if cap_s:
        return (
            f"{stage} CUT SHORT by the time cap ({cap_key} = {cap_s:g} s): {done} of "
            f"{planned} steps; this run's figures are not the fixed-work demo's"
        )
    return f"{stage} ended early: {done} of {planned} steps (the log says why)"
