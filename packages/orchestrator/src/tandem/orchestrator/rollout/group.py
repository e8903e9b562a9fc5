"""One GRPO group: the episodes of one task, played at once, kept whole or dropped whole."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from tandem.agent_env import Env, EnvConfig, SandboxError, Task
from tandem.orchestrator.config import EngineConfig, EpisodeConfig
from tandem.orchestrator.inference.formats import AnyChatFormat
from tandem.orchestrator.protocols import Engine
from tandem.orchestrator.rollout.episode import episode_generator, run_token_episode
from tandem.orchestrator.wire import PlayedGroup, Sample


async def play_group(
    engine: Engine,
    chat: AnyChatFormat,
    task: Task,
    *,
    env: EnvConfig,
    episode: EpisodeConfig,
    engine_cfg: EngineConfig,
    seed: int,
    index: int,
    group_size: int,
    open_env: Callable[[Task, EnvConfig], Any] = Env,
) -> PlayedGroup:
    """Play ``group_size`` episodes of ``task`` at once (episode j seeded by (seed, index, j)).

    An episode still running past its wall budget plus grading has overrun every limit it
    has (a stalled sandbox or engine): it is cut and its group dropped, never half-kept.
    """
    budget = env.episode_wall_s + env.grade_timeout_s
    results = await asyncio.gather(
        *(
            asyncio.wait_for(
                run_token_episode(
                    engine,
                    chat,
                    task,
                    env,
                    max_new_tokens=engine_cfg.max_new_tokens,
                    max_observation_chars=episode.max_observation_chars,
                    generator=episode_generator(seed, index, j),
                    stop_malformed=engine_cfg.stop_malformed,
                    open_env=open_env,
                    compaction=episode.compaction,
                ),
                timeout=budget,
            )
            for j in range(group_size)
        ),
        return_exceptions=True,
    )
    cut = sum(isinstance(r, TimeoutError) for r in results)
    if cut:
        return PlayedGroup(index=index, dropped=f"{cut} episodes past {budget:g} s", cut=cut)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        if not all(isinstance(e, SandboxError) for e in errors):
            raise next(e for e in errors if not isinstance(e, SandboxError))
        return PlayedGroup(index=index, dropped=f"sandbox: {errors[0]}")
    return PlayedGroup(index=index, samples=[r for r in results if isinstance(r, Sample)])
