"""The ``local`` backend: one engine and the trainer in this process (``process``: the engine
in a child process of it).

The engine decodes in a worker thread and the trainer steps in another, while sandboxed
tool calls run on the event loop; with ``rl.backend = "process"`` the engine, its event loop
and the sandboxes run in a child process instead (`ProcessRollouts`), so that their Python
and the trainer's do not wait on one GIL. The trainer trains the run's policy in place and publishes
each version into the run's weight stream; the engine (a copy of the policy) pulls it and
applies it between decoding steps. `batch_invariant()` is held for the whole run, so the
engine's log-probs are the trainer's bit for bit. With ``engine.kind = "vllm"`` the rollouts
run on vLLM servers instead (`local_vllm`), which follow the same stream in place.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

from tandem.moe_determinism import MoETransformer, batch_invariant
from tandem.orchestrator.artifacts.checkpoint import load_weights, optimizer_state
from tandem.orchestrator.backends.local_process import ProcessRollouts
from tandem.orchestrator.backends.local_vllm import vllm_rollouts
from tandem.orchestrator.backends.ray.worker import WorkerSpec
from tandem.orchestrator.config import ConfigValueError, RunConfig
from tandem.orchestrator.inference.embedded.engine import InferenceEngine
from tandem.orchestrator.inference.formats import AnyChatFormat, chat_format_for
from tandem.orchestrator.policy import clone_model
from tandem.orchestrator.protocols import BackendStart
from tandem.orchestrator.rollout.local import LocalRollouts
from tandem.orchestrator.rollout.tasks import TaskSource
from tandem.orchestrator.rollout.vllm import VllmRollouts
from tandem.orchestrator.training.trainer import RLTrainer
from tandem.orchestrator.training.weights import WeightPublisher, stream_store, stream_url


@dataclass
class LocalBackend:
    rollouts: LocalRollouts | VllmRollouts | ProcessRollouts
    trainer: RLTrainer
    sink: WeightPublisher
    scope: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    async def close(self) -> None:
        try:
            await self.rollouts.close()
            self.sink.close()  # its encode and upload threads
        finally:
            self.scope.close()


def build(
    start: BackendStart,
    *,
    policy: MoETransformer,
    config: RunConfig,
    tasks: TaskSource,
    run_dir: Path,
) -> LocalBackend:
    """The trainer on ``policy`` (restored from ``start`` when resuming; the KL reference
    is the policy as given), the version ``start.version`` published, and one engine on it."""
    if config.rl.backend == "process" and start.on_engine_update is not None:
        raise ConfigValueError(
            'rl.backend: engine-update hooks run in the engine\'s process, so they need "local"'
        )
    scope = contextlib.ExitStack()
    scope.enter_context(batch_invariant(config.engine.deterministic))
    engine_cfg = config.engine
    chat = chat_format_for(policy.config.path)
    trainer = RLTrainer(
        policy,
        config.trainer,
        deterministic=engine_cfg.deterministic,
        temperature=engine_cfg.temperature,
        vocab=chat.tok.vocab_size,
    )
    if start.resume is not None:
        load_weights(policy, start.resume)
        trainer.optimizer.load_state_dict(optimizer_state(start.resume))
    sink = WeightPublisher(
        stream_store(config.rl.weights_store, run_dir, start.stream),
        policy,
        anchor_every=config.rl.anchor_every,
    )
    sink.publish(start.version)
    rollouts: LocalRollouts | VllmRollouts | ProcessRollouts
    if config.rl.backend == "process":
        rollouts = _process_rollouts(
            start, policy=policy, config=config, tasks=tasks, run_dir=run_dir
        )
    elif engine_cfg.kind == "vllm":
        rollouts = vllm_rollouts(
            scope, start, policy=policy, config=config, tasks=tasks, run_dir=run_dir, chat=chat
        )
    else:
        rollouts = _embedded_rollouts(
            start, policy=policy, config=config, tasks=tasks, chat=chat, sink=sink
        )
    return LocalBackend(rollouts, trainer, sink, scope)


def _embedded_rollouts(
    start: BackendStart,
    *,
    policy: MoETransformer,
    config: RunConfig,
    tasks: TaskSource,
    chat: AnyChatFormat,
    sink: WeightPublisher,
) -> LocalRollouts:
    """An embedded engine on a copy of ``policy``, following ``sink``'s stream."""
    engine = InferenceEngine(
        clone_model(policy),
        config.engine,
        stop_id=chat.end_id,
        version=start.version,
        vocab=chat.tok.vocab_size,
    )
    engine.on_apply = start.on_engine_update
    return LocalRollouts(
        engine,
        sink.subscriber(start.version),
        tasks,
        chat=chat,
        env=config.env,
        episode=config.episode,
        engine_cfg=config.engine,
        seed=config.run.seed,
        group_size=config.rl.group_size,
    )


def _process_rollouts(
    start: BackendStart,
    *,
    policy: MoETransformer,
    config: RunConfig,
    tasks: TaskSource,
    run_dir: Path,
) -> ProcessRollouts:
    """An embedded engine in a child process, following the run's stream by itself."""
    store_url = stream_url(config.rl.weights_store, run_dir, start.stream)
    spec = WorkerSpec.for_run(config, policy.config, tasks, store_url)
    return ProcessRollouts(spec, torch_threads=config.rl.torch_threads)
