"""Held-out tasks played on vLLM servers (``engine.kind = "vllm"``).

The policy is written in the Hugging Face layout for a server that tandem starts (or
served already by the servers ``engine.vllm.urls`` names), and every episode runs as with
the embedded engine: same tasks, same seeds per episode, same scoring. The server batches
the concurrent episodes itself, so one engine process plays them all.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from tandem.agent_env import Task
from tandem.moe_determinism import MoETransformer
from tandem.moe_determinism.model.hf import save_hf
from tandem.orchestrator.config import RunConfig
from tandem.orchestrator.eval.evaluate import play_tasks
from tandem.orchestrator.inference.formats import chat_format_for
from tandem.orchestrator.inference.vllm.engine import VllmEngine
from tandem.orchestrator.inference.vllm.serving import vllm_servers
from tandem.orchestrator.wire import Sample


def play_on_vllm(
    model: MoETransformer,
    config: RunConfig,
    tasks: Sequence[Task],
    *,
    samples: int,
    log_dir: Path,
    on_sample: Callable[[], None] | None = None,
) -> list[list[Sample]]:
    """Play ``tasks`` (ids 0.. of the held-out set) on vLLM; samples task by task."""
    chat = chat_format_for(model.config.path)
    mc = model.config
    engine_cfg = config.engine
    with tempfile.TemporaryDirectory(prefix="tandem-vllm-policy-") as tmp:
        policy_dir = save_hf(model, tmp) if not engine_cfg.vllm.urls else Path(tmp)
        with vllm_servers(
            policy_dir, mc, engine_cfg, log_dir=log_dir, seed=config.run.seed
        ) as servers:
            engine = VllmEngine.for_policy(servers.urls, engine_cfg, mc, chat)

            async def go() -> list[list[Sample]]:
                try:
                    return await play_tasks(
                        engine,
                        chat,
                        tasks,
                        config.env,
                        samples_per_task=samples,
                        max_new_tokens=engine_cfg.max_new_tokens,
                        max_observation_chars=config.episode.max_observation_chars,
                        compaction=config.episode.compaction,
                        seed=config.run.seed,
                        stop_malformed=engine_cfg.stop_malformed,
                        on_sample=on_sample,
                    )
                finally:
                    await engine.close()

            return asyncio.run(go())
