"""Per-step metrics: one JSONL record per step, appended and flushed as the run goes.

A resumed run appends to the same file; records at or after the resume step are dropped
first, so the file never holds a step twice (a killed run may have logged a step that its
last checkpoint does not include).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any


def _clean(value: Any) -> Any:
    """JSON-safe scalars: NaN/inf become None (strict JSON has no such numbers)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        return _clean(value.item())
    return value


class MetricsLog:
    """Append-only ``metrics.jsonl`` with a ``step`` key in every record."""

    def __init__(self, path: str | Path, *, resume_from_step: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_from_step is not None and self.path.exists():
            kept = [r for r in read_metrics(self.path) if r["step"] < resume_from_step]
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(tmp, self.path)
        elif resume_from_step is None and self.path.exists():
            self.path.unlink()
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        record = {"step": step, **_clean(dict(metrics))}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All complete records of a metrics file (a torn last line from a crash is skipped)."""
    return list(_iter_records(Path(path)))


def _iter_records(path: Path) -> Iterator[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and "step" in record:
                yield record
