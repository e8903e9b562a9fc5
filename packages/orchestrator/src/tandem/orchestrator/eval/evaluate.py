"""pass@k of a policy on a task set, played by an engine in the real environment.

Every task is played ``samples_per_task`` times with seeded sampling (the same seeds for
every policy, so two policies' results pair task by task) and scored by `passk.summarize`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import structlog

from tandem.agent_env import EnvConfig, Task
from tandem.orchestrator.eval.passk import EvalResult, summarize
from tandem.orchestrator.inference.formats import AnyChatFormat
from tandem.orchestrator.protocols import Engine
from tandem.orchestrator.rollout.episode import episode_generator, run_token_episode
from tandem.orchestrator.rollout.tasks import task_category
from tandem.orchestrator.wire import Sample

log = structlog.get_logger()


async def evaluate(
    engine: Engine | Sequence[Engine],
    chat: AnyChatFormat,
    tasks: Sequence[Task],
    env_config: EnvConfig,
    *,
    samples_per_task: int,
    max_new_tokens: int,
    max_observation_chars: int,
    seed: int,
    ks: Sequence[int] = (1,),
    stop_malformed: bool = True,
) -> tuple[EvalResult, list[list[Sample]]]:
    """Play every task ``samples_per_task`` times (seeded) and score pass@k.

    With several engines (replicas of one policy), task i is played on engine ``i % n``:
    its samples share their prompt in one engine's prefix cache. Each episode's sampling
    depends only on its seed, so the result is the same with one engine or several."""
    engines = [engine] if not isinstance(engine, Sequence) else list(engine)
    if not engines:
        raise ValueError("evaluate: needs at least one engine")
    total = len(tasks) * samples_per_task
    done = 0

    async def one(i: int, j: int) -> Sample:
        nonlocal done
        sample = await run_token_episode(
            engines[i % len(engines)],
            chat,
            tasks[i],
            env_config,
            max_new_tokens=max_new_tokens,
            max_observation_chars=max_observation_chars,
            generator=episode_generator(seed, 7_777_777, i, j),
            stop_malformed=stop_malformed,
        )
        done += 1
        if done % max(1, total // 8) == 0 or done == total:
            log.info("eval.progress", done=done, total=total)
        return sample

    flat = await asyncio.gather(
        *(one(i, j) for i in range(len(tasks)) for j in range(samples_per_task))
    )
    per_task = [
        list(flat[i * samples_per_task : (i + 1) * samples_per_task]) for i in range(len(tasks))
    ]
    return summarize(per_task, ks, [task_category(t) for t in tasks]), per_task
