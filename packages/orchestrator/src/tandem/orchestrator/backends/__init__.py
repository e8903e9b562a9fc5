"""Where a run's engines and trainer live: in this process (``local``) or as Ray actors.

`RLRun` drives both the same way; these functions build the pieces for ``rl.backend``.
"""

from __future__ import annotations

from typing import Any

import structlog

from tandem.moe_determinism import MoETransformer
from tandem.orchestrator.chat_format import ChatFormat
from tandem.orchestrator.config import (
    ConfigValueError,
    EngineConfig,
    EnvSettings,
    RLConfig,
    TrainerConfig,
)
from tandem.orchestrator.engine import InferenceEngine
from tandem.orchestrator.policy import clone_model
from tandem.orchestrator.rollouts import LocalRollouts
from tandem.orchestrator.tasks import TaskSource
from tandem.orchestrator.trainer import RLTrainer
from tandem.orchestrator.weights import state_for_sync

log = structlog.get_logger()


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
        log.warning("ray.resources_short", detail=what, hint="actors wait until nodes join")
        short.append(what)
    return short


def ray_trainer(
    policy: MoETransformer,
    local: RLTrainer,
    *,
    rl: RLConfig,
    trainer: TrainerConfig,
    engine: EngineConfig,
    store_url: str,
    run_name: str,
    resumed: bool,
) -> tuple[bool, Any]:
    """The trainer ranks as Ray actors, starting from ``policy``'s weights (and, on resume,
    ``local``'s optimizer state); they publish the stream at ``store_url`` from its first
    version. Returns (whether this call started Ray, the `RayTrainer`)."""
    from tandem.orchestrator.ray_backend import connect
    from tandem.orchestrator.ray_trainer import RayTrainer, TrainerSpec

    started = connect(rl.ray)
    check_cluster_fits(rl, trainer.processes, started_here=started)
    spec = TrainerSpec(
        model=policy.config,
        trainer=trainer,
        deterministic=engine.deterministic,
        temperature=engine.temperature,
        store_url=store_url,
        anchor_every=rl.anchor_every,
        torch_threads=rl.ray.torch_threads,
        nice=rl.ray.trainer_nice,
    )
    optimizer = local.grpo.optimizer.state_dict() if resumed else None
    reference = None if local.reference is None else state_for_sync(local.reference)
    remote = RayTrainer(
        spec,
        rl.ray,
        state={k: v.clone() for k, v in state_for_sync(policy).items()},
        version=local.policy_version,
        optimizer_state=optimizer,
        run_name=run_name,
        reference=reference,
    )
    return started, remote


def make_rollouts(
    policy: MoETransformer,
    publisher: Any,
    version: int,
    *,
    rl: RLConfig,
    engine: EngineConfig,
    env: EnvSettings,
    tasks: TaskSource,
    seed: int,
    pull_url: str,
    run_name: str,
    stream: int,
) -> Any:
    """The run's rollout side, starting at ``version``: one engine here following
    ``publisher``'s stream (``local``), or rollout actors pulling from ``pull_url``
    (``ray``)."""
    if rl.backend == "ray":
        from tandem.orchestrator.ray_backend import RayRollouts, WorkerSpec

        spec = WorkerSpec(
            model=policy.config,
            engine=engine,
            env=env,
            tasks=tasks.config,
            task_seed=tasks.seed,
            task_offset=tasks.offset,
            seed=seed,
            group_size=rl.group_size,
            store_url=pull_url,
        )
        return RayRollouts(spec, rl.ray, run_name=run_name, stream=stream)
    engine_here = InferenceEngine(
        clone_model(policy), engine, stop_id=ChatFormat().end_id, version=version
    )
    return LocalRollouts(
        engine_here,
        publisher.subscriber(version),
        tasks,
        env=env,
        engine_cfg=engine,
        seed=seed,
        group_size=rl.group_size,
    )
