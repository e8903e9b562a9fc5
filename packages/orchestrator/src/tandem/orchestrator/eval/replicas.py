"""Held-out tasks played by engine replicas in worker processes.

An embedded engine decoding a small model spends most of its time in Python between torch
ops, so replicas as threads of one process wait for each other's GIL (two gained 1.22x on
two cores). Each replica here is a spawned process (a forked torch whose OpenMP pool has
run can hang) with one torch thread and its own copy of the policy, and plays every n-th
task. An episode's sampling depends only on its seed (task id and sample number), so the
episodes, and every score made of them, equal those of one engine playing every task.

Spawning re-imports the caller's ``__main__`` module: a script that evaluates on several
replicas needs the ``if __name__ == "__main__":`` guard, as any multiprocessing program.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import pickle
import queue
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.queues import Queue
from typing import Any

import torch

from tandem.agent_env import Task
from tandem.moe_determinism import MoETransformer, batch_invariant
from tandem.orchestrator.config import RunConfig
from tandem.orchestrator.eval.evaluate import play_tasks
from tandem.orchestrator.inference.embedded.engine import InferenceEngine
from tandem.orchestrator.inference.embedded.server import EngineServer
from tandem.orchestrator.inference.formats import chat_format_for
from tandem.orchestrator.policy import clone_model
from tandem.orchestrator.runtime.allocator import reuse_freed_memory
from tandem.orchestrator.runtime.lifetime import end_with_parent
from tandem.orchestrator.runtime.priority import run_when_idle
from tandem.orchestrator.runtime.worker_logging import driver_log_level, log_from
from tandem.orchestrator.wire import Sample

POLL_S = 1.0
"""How often the parent checks that its replicas are alive while it waits for them."""


class ReplicaFailed(RuntimeError):
    """An evaluation replica raised or died; the message carries its traceback or exit code."""


def play_here(
    model: MoETransformer,
    config: RunConfig,
    tasks: Sequence[Task],
    task_ids: Sequence[int],
    *,
    samples: int,
    on_sample: Callable[[], None] | None = None,
) -> list[list[Sample]]:
    """Play ``tasks`` (ids ``task_ids`` in the held-out set) on one engine in this process
    that takes ``model`` over (pass a copy of a model that will be trained afterwards)."""
    engine_cfg = config.engine
    chat = chat_format_for(model.config.path)
    engine = InferenceEngine(model, engine_cfg, stop_id=chat.end_id, vocab=chat.tok.vocab_size)

    async def go() -> list[list[Sample]]:
        server = EngineServer(engine)
        serving = asyncio.create_task(server.serve())
        try:
            return await play_tasks(
                server,
                chat,
                tasks,
                config.env,
                samples_per_task=samples,
                max_new_tokens=engine_cfg.max_new_tokens,
                max_observation_chars=config.episode.max_observation_chars,
                compaction=config.episode.compaction,
                seed=config.run.seed,
                task_ids=task_ids,
                stop_malformed=engine_cfg.stop_malformed,
                on_sample=on_sample,
            )
        finally:
            server.close()
            await asyncio.gather(serving, return_exceptions=True)

    with batch_invariant(engine_cfg.deterministic):
        return asyncio.run(go())


@dataclass(frozen=True)
class _Share:
    """What one replica process is given: the policy (pickled once by the parent, so
    torch's multiprocessing does not move the caller's weights into shared memory), the
    config and its tasks, and the parent's process id (the replica ends with it)."""

    replica: int
    parent: int
    policy: bytes
    config: RunConfig
    tasks: list[Task]
    task_ids: list[int]
    samples: int
    log_level: int
    when_idle: bool = False


def _replica_main(share: _Share, out: Queue[tuple[Any, ...]]) -> None:
    """A replica process: one torch thread, its share of the tasks, a message per episode
    (the parent logs progress) and then its samples, or its traceback. Its allocator keeps
    freed blocks mapped, as the CLI's own process does: a prefill's temporaries are mapped
    afresh otherwise, and faulting them in cost 6% of their CPU."""
    end_with_parent(share.parent)
    if share.when_idle:
        run_when_idle()  # before its sandboxes start: they inherit it
    torch.set_num_threads(1)
    log_from(share.log_level)()
    reuse_freed_memory()
    try:
        model = pickle.loads(share.policy)
        per_task = play_here(
            model,
            share.config,
            share.tasks,
            share.task_ids,
            samples=share.samples,
            on_sample=lambda: out.put(("sample", share.replica)),
        )
        out.put(("done", share.replica, per_task))
    except BaseException:
        out.put(("failed", share.replica, traceback.format_exc()))


def play_on_replicas(
    model: MoETransformer,
    config: RunConfig,
    tasks: Sequence[Task],
    *,
    samples: int,
    replicas: int,
    on_sample: Callable[[], None] | None = None,
    when_idle: bool = False,
) -> list[list[Sample]]:
    """Play ``tasks`` (the whole held-out set, ids 0..) on ``replicas`` worker processes,
    task i on replica ``i % replicas``; returns the samples task by task. A replica that
    fails stops the others and raises `ReplicaFailed` with its traceback; the replicas end
    with this process when it is killed (`end_with_parent`). ``when_idle``: the replicas
    and their sandboxes run only on cores nothing else wants (`run_when_idle`), so an
    evaluation beside other work takes only the CPU time that work leaves (not with one
    replica, which plays in this process)."""
    replicas = max(1, min(replicas, len(tasks)))
    if replicas == 1:
        return play_here(
            clone_model(model),
            config,
            tasks,
            range(len(tasks)),
            samples=samples,
            on_sample=on_sample,
        )
    policy = pickle.dumps(model)
    ctx = multiprocessing.get_context("spawn")
    out: Queue[tuple[Any, ...]] = ctx.Queue()
    level = max(driver_log_level(), logging.WARNING)  # progress comes from this process
    procs = [
        ctx.Process(
            target=_replica_main,
            args=(
                _Share(
                    replica=r,
                    parent=os.getpid(),
                    policy=policy,
                    config=config,
                    tasks=list(tasks[r::replicas]),
                    task_ids=list(range(r, len(tasks), replicas)),
                    samples=samples,
                    log_level=level,
                    when_idle=when_idle,
                ),
                out,
            ),
            name=f"tandem-eval-replica-{r}",
            daemon=True,
        )
        for r in range(replicas)
    ]
    del policy
    shares: dict[int, list[list[Sample]]] = {}
    gone: set[int] = set()
    try:
        for p in procs:
            p.start()
        while len(shares) < replicas:
            try:
                message = out.get(timeout=POLL_S)
            except queue.Empty:
                _check_alive(procs, shares, gone)
                continue
            kind, r = message[0], message[1]
            if kind == "sample":
                if on_sample is not None:
                    on_sample()
            elif kind == "done":
                shares[r] = message[2]
            else:
                raise ReplicaFailed(f"evaluation replica {r} failed:\n{message[2]}")
    finally:
        for p in procs:
            if p.is_alive() and len(shares) < replicas:
                p.terminate()
            p.join(timeout=10)
        out.close()
    per_task: list[list[Sample]] = [[] for _ in tasks]
    for r, share in shares.items():
        for k, samples_of_task in enumerate(share):
            per_task[r + k * replicas] = samples_of_task
    return per_task


def _check_alive(
    procs: Sequence[multiprocessing.process.BaseProcess],
    shares: dict[int, list[list[Sample]]],
    gone: set[int],
) -> None:
    """Raise when a replica whose samples have not come is gone: at once when it was killed
    (a signal, out of memory), and after a whole quiet poll when it exited cleanly (what a
    process sends is in the pipe before it exits, so by then it was lost, e.g. unpicklable)."""
    for r, p in enumerate(procs):
        if r in shares or p.exitcode is None:
            continue
        if p.exitcode != 0:
            raise ReplicaFailed(
                f"evaluation replica {r} exited with code {p.exitcode} before sending its "
                "samples (killed, or out of memory?)"
            )
        if r in gone:
            raise ReplicaFailed(f"evaluation replica {r} exited without sending its samples")
        gone.add(r)
