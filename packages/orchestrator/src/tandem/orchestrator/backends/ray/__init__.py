"""The ``ray`` backend: rollout actors and trainer ranks on a Ray cluster.

`rollouts` holds the rollout actors (each one engine following the weight store by itself),
the pool that grows and drains while training runs (`PoolControl`, ``tandem workers``) and
the driver's view of them; `trainer` the data-parallel trainer ranks (FSDP or DDP) and their
publishes; `envs` the environment-pool actors that run episodes' sandboxes apart from the
engines; `cluster` joining or starting the cluster and checking the actors fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tandem.moe_determinism import MoETransformer
from tandem.orchestrator.artifacts.checkpoint import load_weights, optimizer_state
from tandem.orchestrator.backends.ray.cluster import check_cluster_fits, connect
from tandem.orchestrator.backends.ray.rollouts import RayRollouts
from tandem.orchestrator.backends.ray.trainer import RaySink, RayTrainer, TrainerSpec
from tandem.orchestrator.backends.ray.worker import WorkerSpec
from tandem.orchestrator.config import ConfigValueError, RunConfig
from tandem.orchestrator.inference.formats import chat_format_for
from tandem.orchestrator.protocols import BackendStart
from tandem.orchestrator.rollout.tasks import TaskSource
from tandem.orchestrator.training.weights import state_for_sync, stream_url


@dataclass
class RayBackend:
    rollouts: RayRollouts
    trainer: RayTrainer
    sink: RaySink
    policy: MoETransformer
    own_cluster: bool

    async def close(self) -> None:
        import ray

        try:
            await self.rollouts.close()
            state, _ = self.trainer.checkpoint_state()
            self.policy.load_state_dict(state)  # the run's result lives in this process
            self.trainer.close()
        finally:
            if self.own_cluster:
                ray.shutdown()


def build(
    start: BackendStart,
    *,
    policy: MoETransformer,
    config: RunConfig,
    tasks: TaskSource,
    run_dir: Path,
) -> RayBackend:
    """Trainer ranks starting from ``policy`` (or ``start``'s checkpoint), publishing the
    run's stream from ``start.version``, and the rollout actors following it."""
    if start.on_engine_update is not None:
        raise ConfigValueError(
            "rl.backend: engine-update hooks run in the engine's process, so they need the "
            "local backend"
        )
    rl, engine = config.rl, config.engine
    own = connect(rl.ray)
    # a joined cluster may still grow: a shortfall there is a warning, not an error
    check_cluster_fits(rl, config.trainer.processes, started_here=own and not rl.ray.address)
    # the KL reference is the policy the run started from, before any checkpoint
    reference = state_for_sync(policy) if config.trainer.loss.kl_coef > 0 else None
    reference = None if reference is None else {k: v.clone() for k, v in reference.items()}
    optimizer = None
    if start.resume is not None:
        load_weights(policy, start.resume)
        optimizer = optimizer_state(start.resume)
    spec = TrainerSpec(
        model=policy.config,
        trainer=config.trainer,
        deterministic=engine.deterministic,
        temperature=engine.temperature,
        vocab=chat_format_for(policy.config.path).tok.vocab_size,
        store_url=stream_url(rl.weights_store, run_dir, start.stream),
        anchor_every=rl.anchor_every,
        torch_threads=rl.ray.torch_threads,
        nice=rl.ray.trainer_nice,
    )
    worker = WorkerSpec.for_run(
        config,
        policy.config,
        tasks,
        stream_url(rl.ray.pull_from or rl.weights_store, run_dir, start.stream),
    )
    # the rollout actors and their environment pools start beside the trainer ranks
    rollouts = RayRollouts(worker, rl.ray, run_name=config.run.name, stream=start.stream)
    try:
        trainer = RayTrainer(
            spec,
            rl.ray,
            state={k: v.clone() for k, v in state_for_sync(policy).items()},
            optimizer_state=optimizer,
            run_name=f"{config.run.name}-{start.stream}",
            reference=reference,
            while_starting=rollouts.request_actors,
        )
        sink = RaySink(trainer)
        sink.publish(start.version)
    except BaseException:
        rollouts.drop_requested()
        raise
    return RayBackend(rollouts, trainer, sink, policy, own)
