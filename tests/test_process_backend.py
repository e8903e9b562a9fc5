"""``rl.backend = "process"``: the engine, its episodes and sandboxes in a child process.

The child follows the run's weight store by itself; a pipelined run (whose schedule does
not depend on timing) gives the in-process backend's weights bit for bit, the engine's
log-probs equal the trainer's on same-version samples, the child's log events are logged
by the parent, a killed child stops the run with its exit code, and what the child cannot
do is refused before any work.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import msgspec
import pytest
import structlog
from rl_helpers import parity, tiny_config, tiny_run

from tandem.orchestrator.artifacts.metrics import read_metrics
from tandem.orchestrator.backends.local_process import RolloutProcessFailed
from tandem.orchestrator.config import ConfigValueError, EngineConfig, RLConfig
from tandem.orchestrator.rl.hooks import RunHooks
from tandem.orchestrator.stages import check_rl_engine
from tandem.orchestrator.training.weights import state_for_sync, weights_equal

PIPELINED = RLConfig(
    mode="pipelined", steps=3, group_size=3, groups_per_step=2, checkpoint_every=9, torch_threads=1
)


def test_process_engine_gives_the_in_process_run_bit_for_bit(tmp_path: Path) -> None:
    local = tiny_run(tmp_path / "local", PIPELINED, RunHooks(reward=parity), check_rows=2)
    local_summary = local.run()
    rl = msgspec.structs.replace(PIPELINED, backend="process")
    child: list[int | None] = []
    remote = tiny_run(
        tmp_path / "process",
        rl,
        RunHooks(reward=parity, on_step=lambda step, m: child.append(remote.rollouts.pid)),
        check_rows=2,
    )
    saved = structlog.get_config()  # whatever earlier tests configured, given back after
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        cache_logger_on_first_use=False,
    )
    try:
        with structlog.testing.capture_logs() as logged:
            summary = remote.run()
    finally:
        structlog.configure(**saved)

    assert summary.steps_done == local_summary.steps_done == 3
    assert weights_equal(state_for_sync(remote.policy), state_for_sync(local.policy))
    assert summary.staleness_histogram == local_summary.staleness_histogram
    assert summary.trajectories == local_summary.trajectories
    assert len(set(child)) == 1 and child[0] not in (None, os.getpid())
    assert remote.rollouts.version == 2  # pipelined: the child applied versions 1 and 2
    records = read_metrics(tmp_path / "process" / "metrics.jsonl")
    same_version = [r for r in records if r.get("mismatch_tokens")]
    assert same_version and all(r["mismatch_max_abs"] == 0.0 for r in same_version)
    assert all(r["routing_agreement_replay"] == 1.0 for r in records)
    assert not remote.rollouts._proc.is_alive()  # closed with the run
    # the child's events are logged here: its start, and the engine applying each version
    events = [e["event"] for e in logged]
    assert "rollouts.worker_ready" in events
    applied = [e["version"] for e in logged if e["event"] == "delta_sync.applied"]
    assert applied == [0, 1, 2]


def test_async_process_engine_follows_every_version_and_ignores_sigint(tmp_path: Path) -> None:
    rl = RLConfig(
        mode="async",
        backend="process",
        steps=3,
        group_size=3,
        groups_per_step=1,
        max_staleness=1,
        rollout_workers=2,
        checkpoint_every=9,
        torch_threads=1,
    )
    versions: list[int] = []

    def on_step(step: int, _metrics: dict) -> None:
        versions.append(run.rollouts.version)
        if step == 0:  # Ctrl-C in a terminal reaches the child too: it plays on
            os.kill(run.rollouts.pid, signal.SIGINT)

    run = tiny_run(tmp_path, rl, RunHooks(reward=parity, on_step=on_step))
    summary = run.run()
    assert summary.steps_done == 3 and summary.policy_version == 3
    assert versions == sorted(versions) and versions[0] >= 0
    assert max(summary.staleness_histogram) <= 1
    # every group came from a version the child's engine had applied
    assert summary.last_metrics["engine_version"] >= 1


def test_a_killed_rollout_process_stops_the_run_with_its_exit_code(tmp_path: Path) -> None:
    rl = msgspec.structs.replace(PIPELINED, backend="process", steps=6)

    def kill_child(step: int, _metrics: dict) -> None:
        if step == 0:
            os.kill(run.rollouts.pid, signal.SIGKILL)

    run = tiny_run(tmp_path, rl, RunHooks(reward=parity, on_step=kill_child))
    with pytest.raises(RolloutProcessFailed, match=r"exited, code -9"):
        run.run()
    assert not run.rollouts._proc.is_alive()


def test_what_a_child_engine_cannot_do_is_refused_before_any_work(tmp_path: Path) -> None:
    rl = msgspec.structs.replace(PIPELINED, backend="process")
    config = tiny_config(tmp_path, rl)
    vllm = msgspec.structs.replace(config, engine=EngineConfig(kind="vllm"))
    with pytest.raises(ConfigValueError, match=r"rl\.backend = 'process'"):
        check_rl_engine(vllm)
    hooks = RunHooks(reward=parity, on_engine_update=lambda version, state: None)
    with pytest.raises(ConfigValueError, match="engine-update hooks"):
        tiny_run(tmp_path, rl, hooks).run()
