"""What `tandem workers` prints: workers wanted, running and pending, and a warning only
when the cluster's free resources cannot hold a pending worker."""

from __future__ import annotations

from tandem.app.workers import describe, unplaceable

STATUS = {"target": 3, "running": 2, "pending": 1, "worker_resources": {"CPU": 0.5, "GPU": 0.0}}


def test_pending_workers_are_listed_as_pending() -> None:
    assert describe(STATUS) == "3 rollout workers wanted: 2 running, 1 pending"
    assert describe({**STATUS, "running": 3, "pending": 0}) == "3 rollout workers wanted: 3 running"


def test_a_warning_names_what_a_pending_worker_declares_and_what_is_free() -> None:
    warning = unplaceable(STATUS, {"CPU": 0.0, "memory": 1e9})
    assert warning.startswith("1 rollout worker(s) pending: each declares 0.5 CPU")
    assert "the cluster has 0 CPU free" in warning
    assert unplaceable(STATUS, {"CPU": 0.5}) == ""  # room for it: it is starting
    assert unplaceable({**STATUS, "pending": 0}, {}) == ""
    gpu = {**STATUS, "worker_resources": {"CPU": 0.5, "GPU": 1.0}}
    assert "each declares 1 GPU and the cluster has 4 CPU, 0 GPU free" in unplaceable(
        gpu, {"CPU": 4.0}
    )
