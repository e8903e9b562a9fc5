"""The report's step-by-step table: per-category training reward in windows of steps."""

from __future__ import annotations

from tandem.app.rl_trace import trace_table


def _record(step: int, categories: dict[str, tuple[int, float]], **extra: float) -> dict:
    return {
        "step": step,
        "category_reward": {c: {"groups": g, "reward": r} for c, (g, r) in categories.items()},
        **extra,
    }


def test_windows_weigh_each_category_by_its_groups() -> None:
    records = [
        _record(0, {"gcd/off_by_one": (3, 0.5), "gcd/swapped": (1, 0.0)}, entropy=0.2),
        _record(1, {"gcd/off_by_one": (1, 0.1)}, entropy=0.4, kl_to_start_k3=0.01),
        _record(2, {"gcd/swapped": (2, 1.0)}, entropy=0.1, kl_to_start_k3=0.03),
        _record(3, {}, entropy=0.3, kl_to_start_k3=0.05),
    ]
    header, rows = trace_table(records, windows=2)
    assert header == ["steps", "0-1", "2-3"]
    by_label = {r[0]: r[1:] for r in rows}
    # window 0-1: off_by_one (3 x 0.5 + 1 x 0.1) / 4 groups; swapped 1 group at 0.0
    assert by_label["reward gcd/off_by_one"] == ["0.40", "-"]
    assert by_label["reward gcd/swapped"] == ["0.00", "1.00"]
    assert by_label["entropy per loss token (nats)"] == ["0.300", "0.200"]
    assert by_label["KL to the mid-trained policy (k3, sampled tokens)"] == ["0.0100", "0.0400"]
    assert not any(label.startswith("KL penalty") for label in by_label)


def test_more_windows_than_steps_and_old_metrics_files() -> None:
    header, rows = trace_table([_record(0, {"a/b": (2, 0.25)}, kl=0.5)], windows=6)
    assert header == ["steps", "0-0"]
    assert ["KL penalty per loss token (the loss's estimator)", "0.5000"] in rows
    assert trace_table([{"step": 0, "reward": 0.5}]) == ([], [])
