"""Metrics JSONL: strict JSON, resume without duplicate steps, torn lines tolerated."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from tandem.orchestrator.artifacts.metrics import MetricsLog, read_metrics


def test_records_are_strict_json(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    with MetricsLog(path) as log:
        log.log(
            0,
            {"reward": np.float32(0.5), "loss": torch.tensor(1.5), "kl": math.nan, "hist": {1: 2}},
        )
    lines = path.read_text().splitlines()
    assert json.loads(lines[0], parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c))) == {
        "step": 0,
        "reward": 0.5,
        "loss": 1.5,
        "kl": None,
        "hist": {"1": 2},
    }


def test_resume_drops_steps_at_or_after_the_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    with MetricsLog(path) as log:
        for step in range(5):
            log.log(step, {"x": step})
    with open(path, "a") as f:
        f.write('{"step": 5, "x"')  # torn line from a killed process
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2, 3, 4]
    with MetricsLog(path, resume_from_step=3) as log:
        log.log(3, {"x": 30})
    assert [(r["step"], r["x"]) for r in read_metrics(path)] == [(0, 0), (1, 1), (2, 2), (3, 30)]


def test_fresh_run_starts_a_new_file(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    with MetricsLog(path) as log:
        log.log(0, {"x": 1})
    with MetricsLog(path) as log:
        log.log(0, {"x": 2})
    assert read_metrics(path) == [{"step": 0, "x": 2}]
