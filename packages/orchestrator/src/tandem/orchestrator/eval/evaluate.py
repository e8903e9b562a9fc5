"""pass@k of a policy on a task set, played by an engine in the real environment.

Every task is played ``samples_per_task`` times with seeded sampling (the same seeds for
every policy, so two policies' results pair task by task) and scored by `passk.summarize`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import structlog

from tandem.agent_env import EnvConfig, Task
from tandem.orchestrator.compaction_config import CompactionConfig
from tandem.orchestrator.inference.formats import AnyChatFormat
from tandem.orchestrator.protocols import Engine
from tandem.orchestrator.rollout.episode import episode_generator, run_token_episode
from tandem.orchestrator.wire import Sample

log = structlog.get_logger()


def progress_log(total: int) -> Callable[[], None]:
    """A callback for each finished episode that logs ``eval.progress`` eight times in all."""
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        if done % max(1, total // 8) == 0 or done == total:
            log.info("eval.progress", done=done, total=total)

    return tick


async def play_tasks(
    engine: Engine,
    chat: AnyChatFormat,
    tasks: Sequence[Task],
    env_config: EnvConfig,
    *,
    samples_per_task: int,
    max_new_tokens: int,
    max_observation_chars: int,
    seed: int,
    task_ids: Sequence[int] | None = None,
    stop_malformed: bool = True,
    on_sample: Callable[[], None] | None = None,
    compaction: CompactionConfig | None = None,
) -> list[list[Sample]]:
    """Play every task ``samples_per_task`` times, each episode seeded by its task's id in
    the whole task set (``task_ids``, default the position in ``tasks``) and its sample
    number; returns the samples task by task.

    Each episode's sampling depends only on its seed, so the episodes are the same when the
    tasks are split among engines that each play some of them (`replicas`)."""
    ids = list(range(len(tasks))) if task_ids is None else list(task_ids)
    if len(ids) != len(tasks):
        raise ValueError(f"play_tasks: {len(ids)} task ids for {len(tasks)} tasks")

    async def one(i: int, j: int) -> Sample:
        sample = await run_token_episode(
            engine,
            chat,
            tasks[i],
            env_config,
            max_new_tokens=max_new_tokens,
            max_observation_chars=max_observation_chars,
            generator=episode_generator(seed, 7_777_777, ids[i], j),
            stop_malformed=stop_malformed,
            compaction=compaction,
        )
        if on_sample is not None:
            on_sample()
        return sample

    flat = await asyncio.gather(
        *(one(i, j) for i in range(len(tasks)) for j in range(samples_per_task))
    )
    return [
        list(flat[i * samples_per_task : (i + 1) * samples_per_task]) for i in range(len(tasks))
    ]
