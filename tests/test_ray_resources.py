"""Actors that declare more CPUs than the cluster has are never scheduled: on a cluster the run
starts itself that is a config error at start (not a run waiting forever), on a joined one a
warning."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import ray
import structlog

from tandem.orchestrator.backends.ray.cluster import check_cluster_fits, connect
from tandem.orchestrator.config import ConfigValueError, RayConfig, RLConfig
from tandem.orchestrator.rl.hooks import RunHooks

sys.path.insert(0, str(Path(__file__).parent))
from rl_helpers import parity, tiny_run


def _rl(ray_config: RayConfig) -> RLConfig:
    return RLConfig(
        mode="async", steps=1, group_size=2, groups_per_step=1, backend="ray", ray=ray_config
    )


def test_a_cluster_started_here_too_small_for_the_actors_is_a_config_error(tmp_path: Path) -> None:
    assert not ray.is_initialized()
    # one trainer rank (1 CPU) and two rollout actors (1 CPU each) on a 2-CPU cluster
    run = tiny_run(tmp_path, _rl(RayConfig(num_cpus=2, workers=2)), RunHooks(reward=parity))
    with pytest.raises(ConfigValueError) as err:
        run.run()
    message = str(err.value)
    assert "declare 3 CPUs" in message and "the cluster has 2" in message
    assert "rl.ray.worker_cpus x rl.ray.workers = 2" in message
    assert "rl.ray.trainer_cpus x trainer.processes = 1" in message
    assert not ray.is_initialized()  # the cluster it started is gone with it


def test_a_joined_cluster_that_is_short_gets_a_warning_and_keeps_running() -> None:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        short = check_cluster_fits(_rl(RayConfig(workers=3, trainer_gpus=1)), 1, started_here=False)
        # CPUs (4 of 2) and GPUs (1 of 0)
        assert len(short) == 2
        assert "declare 4 CPUs" in short[0] and "the cluster has 2" in short[0]
        assert "declare 1 GPUs" in short[1] and "the cluster has 0" in short[1]
        assert check_cluster_fits(_rl(RayConfig(workers=1)), 1, started_here=False) == []
        assert ray.is_initialized()
    finally:
        ray.shutdown()


def test_actors_log_at_the_drivers_level() -> None:
    """A cluster started by the run gives its workers the driver's structlog level, so an
    info line of every actor does not reach a driver that logs warnings only."""

    @ray.remote
    def worker_level() -> int:
        return int(structlog.get_logger().bind().get_effective_level())

    assert not ray.is_initialized()
    saved = structlog.get_config()  # whatever earlier tests configured, given back after
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    try:
        assert connect(RayConfig(num_cpus=1))
        assert ray.get(worker_level.remote()) == logging.WARNING
    finally:
        ray.shutdown()
        structlog.configure(**saved)
