"""Joining or starting the Ray cluster a run uses, and checking that its actors fit.

A cluster started here runs its workers with this very interpreter and logs at the driver's
level; a joined cluster is taken as it is, with its token authentication (`auth`). An actor whose resources the cluster lacks is
never scheduled and the run would wait for it without a word, so the demands are summed
and checked at start.
"""

from __future__ import annotations

import os
from typing import Any

import structlog

from tandem.orchestrator.backends.ray.auth import unreachable, use_token_if_available
from tandem.orchestrator.backends.ray.envs import RAY_NAMESPACE
from tandem.orchestrator.config import ConfigValueError, RayConfig, RLConfig
from tandem.orchestrator.runtime.worker_logging import driver_log_level, log_from

log = structlog.get_logger()


def connect(config: RayConfig) -> bool:
    """Join ``config.address``, or start a cluster here; True when this call initialized Ray
    (either way: the caller then shuts it down). Whether it started the cluster is
    ``not config.address``.

    A join uses the cluster's token authentication when this machine has a token (see
    `auth`); a cluster that cannot be joined is a `ConfigValueError` saying what to set."""
    no_uv_hook()
    import ray

    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"namespace": RAY_NAMESPACE, "include_dashboard": False}
    level = driver_log_level()
    if level:
        kwargs["runtime_env"] = {"worker_process_setup_hook": log_from(level)}
    if not config.address:
        if config.num_cpus:
            kwargs["num_cpus"] = config.num_cpus
        ray.init(**kwargs)
        return True
    del kwargs["include_dashboard"]  # a joining driver starts no processes of its own
    join_cluster(config.address, **kwargs)
    return True


def join_cluster(address: str, **kwargs: Any) -> None:
    """``ray.init`` on the cluster at ``address``, with its token when this machine has one;
    a `ConfigValueError` in one line when the cluster cannot be joined."""
    no_uv_hook()
    import ray

    mode = use_token_if_available()
    try:
        ray.init(address=address, **kwargs)
    except (ConnectionError, RuntimeError, ray.exceptions.RayError) as e:
        log.debug("ray.join_failed", address=address, error=str(e)[:300])
        raise ConfigValueError(unreachable(address, mode)) from None


def no_uv_hook() -> None:
    """Workers run with the interpreter of their node's `uv run ray start` (every node holds
    the repository), or with this one on a cluster started here: Ray's `uv run` hook would
    ship this directory and re-create the environment for each worker."""
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")


def check_cluster_fits(rl: RLConfig, trainer_processes: int, *, started_here: bool) -> list[str]:
    """Whether the cluster has the CPUs and GPUs the run's actors declare at start; returns
    the shortfalls found on a joined cluster (each also logged as a warning).

    An actor whose resources the cluster lacks is never scheduled, and the run would wait for
    it without a word. A cluster started here has only this machine, so a shortfall is a
    config error (raised after shutting that cluster down); a joined cluster may still grow
    (nodes joining, an autoscaler), so there it is a warning."""
    import ray

    r = rl.ray
    demands = {
        "CPU": {
            "rl.ray.trainer_cpus x trainer.processes": r.trainer_cpus * trainer_processes,
            "rl.ray.worker_cpus x rl.ray.workers": r.worker_cpus * r.workers,
            "rl.ray.env_cpus x rl.ray.env_pools": r.env_cpus * r.env_pools,
        },
        "GPU": {
            "rl.ray.trainer_gpus x trainer.processes": r.trainer_gpus * trainer_processes,
            "rl.ray.worker_gpus x rl.ray.workers": r.worker_gpus * r.workers,
        },
    }
    have = ray.cluster_resources()
    short: list[str] = []
    for kind, parts in demands.items():
        need, available = sum(parts.values()), have.get(kind, 0.0)
        if need <= available + 1e-9:
            continue
        detail = ", ".join(f"{k} = {v:g}" for k, v in parts.items() if v)
        what = f"the actors declare {need:g} {kind}s ({detail}); the cluster has {available:g}"
        if started_here:
            ray.shutdown()
            raise ConfigValueError(
                f"{what}: lower those values, or set rl.ray.num_cpus (0: all of this "
                "machine's CPUs), or join a larger cluster with rl.ray.address"
            )
        log.warning(
            "ray.resources_short",
            detail=what,
            hint="the actors that do not fit wait until nodes join; lower those values to run "
            "on this cluster as it is",
        )
        short.append(what)
    return short
