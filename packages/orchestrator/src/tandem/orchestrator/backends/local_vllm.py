"""The ``local`` backend's inference side on vLLM servers (``engine.kind = "vllm"``).

The policy at the run's start version is written in the Hugging Face layout and served by
a vLLM server that tandem starts (or by ``engine.vllm.urls``, which must serve that same
version); the servers then follow the run's weight stream through tandem's plugin. The
server lives as long as the backend (its exit stack).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from tandem.moe_determinism import MoETransformer
from tandem.moe_determinism.model.hf import hf_layout, save_hf
from tandem.orchestrator.config import RunConfig
from tandem.orchestrator.inference.formats import AnyChatFormat
from tandem.orchestrator.inference.vllm.engine import VllmEngine
from tandem.orchestrator.inference.vllm.serving import vllm_servers
from tandem.orchestrator.protocols import BackendStart
from tandem.orchestrator.rollout.tasks import TaskSource
from tandem.orchestrator.rollout.vllm import VllmRollouts
from tandem.orchestrator.training.weights import stream_url


def vllm_rollouts(
    scope: contextlib.ExitStack,
    start: BackendStart,
    *,
    policy: MoETransformer,
    config: RunConfig,
    tasks: TaskSource,
    run_dir: Path,
    chat: AnyChatFormat,
) -> VllmRollouts:
    """Rollouts on vLLM servers holding ``policy`` as version ``start.version``."""
    mc = policy.config
    work = run_dir / "vllm"
    policy_dir = save_hf(policy, work / f"policy-{start.version}")
    servers = scope.enter_context(
        vllm_servers(policy_dir, mc, config.engine, log_dir=work, seed=config.run.seed)
    )
    engine = VllmEngine.for_policy(
        servers.urls, config.engine, mc, chat, initial_version=start.version
    )
    return VllmRollouts(
        engine,
        stream_url(config.rl.weights_store, run_dir, start.stream),
        hf_layout(policy),
        start.version,
        tasks,
        chat=chat,
        env=config.env,
        episode=config.episode,
        engine_cfg=config.engine,
        seed=config.run.seed,
        group_size=config.rl.group_size,
        servers=servers,
    )
