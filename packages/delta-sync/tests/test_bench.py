"""The benchmark's measurements, checked against slow independent computations."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np

from tandem.delta_sync import bench
from tandem.delta_sync.cli import main


def test_entropy_bound_matches_a_direct_count() -> None:
    rng = np.random.default_rng(0)
    base = {"a": rng.integers(0, 2**16, 5000, dtype=np.uint16), "b": np.zeros(300, np.uint8)}
    new = {k: v.copy() for k, v in base.items()}
    new["a"][rng.random(5000) < 0.05] += np.uint16(1)
    new["a"][::97] -= np.uint16(2)
    new["b"][:7] = 5
    # slow reference: per-element Python loop
    symbols, n = Counter(), 0
    for name in base:
        for x, y in zip(base[name].tolist(), new[name].tolist(), strict=True):
            n += 1
            if x != y:
                width = base[name].itemsize
                symbols[(width, (y - x) % (1 << (8 * width)))] += 1
    k = sum(symbols.values())
    p = k / n
    mask = n * (-p * math.log2(p) - (1 - p) * math.log2(1 - p))
    values = -sum(c * math.log2(c / k) for c in symbols.values())
    assert math.isclose(bench.entropy_bound_bytes(base, new), (mask + values) / 8, rel_tol=1e-9)
    assert math.isclose(bench.changed_fraction(base, new), k / n)


def test_adam_snapshots_change_more_with_a_larger_learning_rate() -> None:
    shapes = bench.moe_shapes(1 << 20)
    fractions = [
        bench.changed_fraction(b, a) for _, b, a in bench.adam_snapshots(shapes, [1e-6, 1e-5])
    ]
    assert 0 < fractions[0] < fractions[1] < 0.5
    assert any("experts" in k for k in shapes)


def test_bench_command_prints_the_table(capsys) -> None:
    assert main(["bench", "--mb", "2", "--lrs", "2e-6", "--repeat", "1", "--workers", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    out = out[next(i for i, line in enumerate(out) if line.lstrip().startswith("lr")) :]
    assert out[0].split()[:5] == ["lr", "changed", "ours", "bound", "ours/bnd"]
    cells = out[1].split()
    ours, bound = float(cells[2].rstrip("x")), float(cells[3].rstrip("x"))
    assert ours > 10 and bound > 10
