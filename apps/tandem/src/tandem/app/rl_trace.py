"""The RL run in windows of steps, from its metrics file: the training reward of each task
category, the policy's entropy, its KL to the mid-trained policy, and the staleness of what
it trained on.

The final per-category table says which categories RL gained or lost; this one says when:
a category that collapses shows its training reward falling window after window while a
sibling category (same function, another bug kind) rises, and the entropy and the KL to the
mid-trained policy show how far and how fast the policy moved while it happened.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

WINDOWS = 6
"""Windows of steps the run is cut into (each a column)."""


def _windows(steps: int, count: int) -> list[range]:
    count = max(1, min(count, steps))
    edges = [round(i * steps / count) for i in range(count + 1)]
    return [range(a, b) for a, b in itertools.pairwise(edges) if b > a]


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def trace_table(
    records: Sequence[dict[str, Any]], windows: int = WINDOWS
) -> tuple[list[str], list[list[str]]]:
    """Header and rows: one row per category (its mean training reward over the groups that
    finished in each window, every group counted, equal-reward ones too), then the mean
    entropy and KL to the start per loss token, and the share of groups trained on one or
    more versions late. Empty when the records carry no per-category rewards."""
    records = [r for r in records if isinstance(r.get("category_reward"), dict)]
    if not records:
        return [], []
    spans = _windows(len(records), windows)
    header = ["steps", *(f"{s.start}-{s.stop - 1}" for s in spans)]
    categories = sorted({c for r in records for c in r["category_reward"]})
    rows: list[list[str]] = []
    for category in categories:
        cells = []
        for span in spans:
            seen = [records[i]["category_reward"].get(category) for i in span]
            groups = sum(s["groups"] for s in seen if s)
            total = sum(s["groups"] * s["reward"] for s in seen if s)
            cells.append(_cell(total / groups if groups else None, ".2f"))
        rows.append([f"reward {category}", *cells])

    def series(key: str, spec: str, label: str) -> None:
        cells = []
        for span in spans:
            values = [records[i][key] for i in span if isinstance(records[i].get(key), int | float)]
            cells.append(_cell(_mean(values), spec))
        rows.append([label, *cells])

    series("entropy", ".3f", "entropy per loss token (nats)")
    series("kl_to_start_k3", ".4f", "KL to the mid-trained policy (k3, sampled tokens)")
    if any(r.get("kl") for r in records):
        series("kl", ".4f", "KL penalty per loss token (the loss's estimator)")
    series("staleness_mean", ".2f", "staleness of trained groups (mean versions)")
    return header, rows
