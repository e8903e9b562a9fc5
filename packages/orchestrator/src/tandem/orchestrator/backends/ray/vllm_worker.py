"""A rollout actor's inference side on a vLLM server of its own (``engine.kind = "vllm"``).

The actor reads the version it starts on from the store, writes it in the Hugging Face
layout to a scratch directory on its node, and starts a vLLM server there on loopback (the
environment is made with uv on first use, as on the local backend). The server then follows
the store through tandem's plugin, so weights reach it as they reach an embedded engine:
by the store (or a region's relay), never through the driver. The server, its scratch
directory and its log live as long as the actor's scope.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import torch

from tandem.agent_env import EnvConfig, Task
from tandem.moe_determinism import MoEConfig, MoETransformer
from tandem.moe_determinism.model.hf import hf_layout, save_hf
from tandem.orchestrator.inference.formats import AnyChatFormat
from tandem.orchestrator.inference.vllm.engine import VllmEngine
from tandem.orchestrator.inference.vllm.serving import vllm_servers
from tandem.orchestrator.rollout.vllm import VllmRollouts

if TYPE_CHECKING:
    from tandem.orchestrator.backends.ray.worker import WorkerSpec

log = structlog.get_logger()


async def vllm_actor_rollouts(
    spec: WorkerSpec,
    name: str,
    scope: contextlib.ExitStack,
    *,
    version: int | None,
    chat: AnyChatFormat,
    open_env: Callable[[Task, EnvConfig], Any],
) -> VllmRollouts:
    """Rollouts for the actor ``name`` (its `WorkerSpec` ``spec``) on a vLLM server it starts
    on ``version`` of the store (default: the newest)."""
    from tandem.delta_sync import Subscriber, open_store

    subscriber = Subscriber(open_store(spec.store_url))
    if version is None:  # the newest, fixed now: the trainer may publish meanwhile
        version = await asyncio.to_thread(subscriber.latest)
        if version is None:
            raise RuntimeError(f"rollout worker {name}: {spec.store_url} holds no version yet")
    state = await asyncio.to_thread(subscriber.materialize, version, as_torch=True)
    work = Path(tempfile.mkdtemp(prefix=f"tandem-vllm-{name}-"))
    scope.callback(shutil.rmtree, work, ignore_errors=True)
    policy = _policy(spec.model, state)
    policy_dir = await asyncio.to_thread(save_hf, policy, work / f"policy-{version}")
    layout = hf_layout(policy)
    del policy, state
    servers = scope.enter_context(
        vllm_servers(policy_dir, spec.model, spec.engine, log_dir=work, seed=spec.seed)
    )
    log.info("ray.vllm_server", worker=name, urls=servers.urls, version=version)
    engine = VllmEngine.for_policy(
        servers.urls, spec.engine, spec.model, chat, initial_version=version
    )
    return VllmRollouts(
        engine,
        spec.store_url,
        layout,
        version,
        spec.task_source(),
        **spec.play_settings(),
        chat=chat,
        servers=servers,
        open_env=open_env,
    )


def _policy(model: MoEConfig, state: dict[str, torch.Tensor]) -> MoETransformer:
    """The model holding ``state`` (the stream's tensors are the model's own state)."""
    with torch.device("meta"):
        policy = MoETransformer(model)
    dtype = next(iter(state.values())).dtype
    policy = policy.to(dtype).to_empty(device="cpu")
    if model.tie_word_embeddings:  # `to_empty` gave the head storage of its own
        policy.lm_head.weight = policy.embed_tokens.weight
    policy.load_state_dict(state)
    return policy.eval()
