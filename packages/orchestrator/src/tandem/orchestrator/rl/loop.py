"""The RL stage: rollout workers, a staleness-bounded buffer, the trainer, weight sync.

``async`` mode runs the two production lines at once in one process: rollout workers play
groups of episodes with the engine (decoding in a worker thread, sandboxed tools on the
event loop) and put them in the buffer; the trainer takes groups as they complete, steps in
another thread, publishes the new version through delta-sync, and the engine pulls it and
applies it between decoding steps. A group produced by version v is trained on only while
trainer_version - v <= max_staleness; workers start a group only while fewer than
``max_ahead`` steps' worth of groups are in flight or waiting, which keeps drops rare.

``sync`` mode alternates: play a step's groups with the current weights, train, publish,
pull, repeat (no overlap, staleness 0). ``pipelined`` mode plays step k+1's groups with
version k while step k trains on version k-1's (overlap in lock step, staleness 1): as
deterministic as ``sync``, without the trainer idling through every rollout.

Where the engines run is the backend's business: ``local`` keeps one engine in this process
(`LocalRollouts`); ``ray`` spreads them over rollout actors on a Ray cluster
(`RayRollouts`), each following the weight store by itself. A group lost with its actor is
played again from the start by another one; nothing partial reaches the trainer.

A failing weight store delays sync without stopping anything: a publish that fails leaves
the version pending and is retried with backoff between trainer steps; the engine keeps
serving the weights it has (its groups age, and past the staleness bound are dropped and
counted) and retries its pull; once the store is back, one pull brings it to the newest
version. (In ``sync`` mode rollouts wait for the publish, by definition.)

Groups whose rewards are all equal carry no GRPO signal; they are counted and skipped and the
trainer waits for more (DAPO's dynamic sampling), so every step learns from
``groups_per_step`` informative groups.

Checkpoints every ``checkpoint_every`` steps hold model, optimizer, policy version, task
cursor and RNGs; a run killed at any instant (SIGKILL included) resumes from the last one
with no repeated or skipped step, on a fresh weight stream.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch

from tandem.delta_sync import warm_up
from tandem.moe_determinism import MoETransformer, batch_invariant
from tandem.orchestrator.backends import make_rollouts, ray_trainer
from tandem.orchestrator.buffer import Group, StalenessBuffer
from tandem.orchestrator.cancel import cancel_and_wait
from tandem.orchestrator.chat_format import ChatFormat
from tandem.orchestrator.checkpoint import CheckpointManager
from tandem.orchestrator.config import (
    ConfigValueError,
    EngineConfig,
    EnvSettings,
    RLConfig,
    TrainerConfig,
)
from tandem.orchestrator.curriculum import SaturationFilter
from tandem.orchestrator.episode import Sample
from tandem.orchestrator.metrics import MetricsLog
from tandem.orchestrator.rollouts import (
    RETRY_MAX_S,
    RETRY_S,
    LocalRollouts,
    PlayedGroup,
    WorkerLost,
)
from tandem.orchestrator.run_metrics import RunSummary, step_metrics
from tandem.orchestrator.step_log import StepProgress, log_step
from tandem.orchestrator.tasks import TaskSource
from tandem.orchestrator.threads import torch_threads
from tandem.orchestrator.trainer import RLTrainer
from tandem.orchestrator.weights import (
    WeightPublisher,
    state_for_sync,
    stream_store,
    stream_url,
)

log = structlog.get_logger()

NO_SIGNAL_REPORT_EVERY = 32
"""Equal-reward groups in a row between two `rl.no_signal` warnings."""

StepCallback = Callable[[int, dict[str, Any]], Any]
"""Called with (step, metrics) after each step; a returned awaitable is awaited before the
next step."""


@dataclass
class RunHooks:
    """Observers for tests and tools: called with (version, state) on the trainer side after
    each publish and on the engine side after each applied pull, and with (step, metrics)."""

    on_publish: Callable[[int, dict[str, torch.Tensor]], None] | None = None
    on_engine_update: Callable[[int, dict[str, torch.Tensor]], None] | None = None
    on_step: StepCallback | None = None
    on_group: Callable[[Group[Sample]], None] | None = None
    reward: Callable[[Sample], float] | None = None
    """Replaces the environment's reward (wiring tests use it to get non-constant groups)."""


class RLRun:
    """One RL run in ``run_dir`` (resumes from its checkpoints when present)."""

    def __init__(
        self,
        policy: MoETransformer,
        *,
        rl: RLConfig,
        trainer: TrainerConfig,
        engine: EngineConfig,
        env: EnvSettings,
        tasks: TaskSource,
        run_dir: str | Path,
        seed: int = 0,
        hooks: RunHooks | None = None,
        progress: bool = False,
        max_wall_s: float | None = None,
        name: str | None = None,
    ) -> None:
        self.policy = policy
        self.name = name or Path(run_dir).name  # names the run's Ray actors
        if trainer.processes > rl.groups_per_step:
            raise ConfigValueError(
                f"trainer.processes ({trainer.processes}) exceeds rl.groups_per_step "
                f"({rl.groups_per_step}): every trainer rank trains on whole groups"
            )
        self.rl, self.trainer_cfg, self.engine_cfg, self.env = rl, trainer, engine, env
        self.tasks = tasks
        self.run_dir = Path(run_dir)
        self.seed = seed
        self.hooks = hooks or RunHooks()
        self.progress = progress
        self.max_wall_s = max_wall_s
        self.chat = ChatFormat()
        self.checkpoints = CheckpointManager(self.run_dir / "checkpoints", keep=rl.keep_checkpoints)

    # -- setup -----------------------------------------------------------------------------
    def _setup(self) -> None:
        self.trainer = RLTrainer(
            self.policy,
            self.trainer_cfg,
            deterministic=self.engine_cfg.deterministic,
            temperature=self.engine_cfg.temperature,
        )
        self.step, self.cursor, self.stream = 0, 0, 0
        self.curriculum = SaturationFilter(self.rl.curriculum, self.seed)
        if self.checkpoints.latest_step() is not None:
            meta = self.checkpoints.load(model=self.policy, optimizer=self.trainer.grpo.optimizer)
            self.step, self.cursor = meta.step, meta.task_cursor
            self.trainer.policy_version = meta.policy_version
            self.stream = int(meta.extra.get("stream", 0)) + 1
            self.curriculum.load(meta.extra.get("curriculum", {}))
            log.info(
                "rl.resumed", step=self.step, policy_version=meta.policy_version, stream=self.stream
            )
        self.local_trainer = self.trainer
        self._own_ray = False
        if self.rl.backend == "ray":
            self._own_ray, self.trainer = ray_trainer(
                self.policy,
                self.local_trainer,
                rl=self.rl,
                trainer=self.trainer_cfg,
                engine=self.engine_cfg,
                store_url=stream_url(self.rl.weights_store, self.run_dir, self.stream),
                run_name=f"{self.name}-{self.stream}",
                resumed=self.step > 0,
            )
            self.publisher = self.trainer
        else:
            self.publisher = WeightPublisher(
                stream_store(self.rl.weights_store, self.run_dir, self.stream),
                anchor_every=self.rl.anchor_every,
            )
        self.publisher.publish(self.trainer.policy_version, self.policy)
        self.rollouts = make_rollouts(
            self.policy,
            self.publisher,
            self.trainer.policy_version,
            rl=self.rl,
            engine=self.engine_cfg,
            env=self.env,
            tasks=self.tasks,
            seed=self.seed,
            pull_url=stream_url(
                self.rl.ray.pull_from or self.rl.weights_store, self.run_dir, self.stream
            ),
            run_name=self.name,
            stream=self.stream,
        )
        max_staleness = {"sync": 0, "pipelined": 1}.get(self.rl.mode, self.rl.max_staleness)
        self.buffer: StalenessBuffer[Sample] = StalenessBuffer(
            max_staleness, self.rl.buffer_capacity
        )
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl", resume_from_step=self.step)
        self.filtered = 0
        self._no_signal_run = [0, 0]  # equal-reward groups in a row: all rewarded, all not
        self.started = 0
        self.trajectories = 0
        self.busy_s = self.wait_s = 0.0
        self._requeued: list[int] = []  # groups lost with their rollout worker, to play again
        self.requeued_total = 0
        self._trainer_busy = asyncio.Lock()  # held while the trainer's weights may change
        self._publish_failed = asyncio.Event()
        self._next: asyncio.Task[list[Group[Sample]]] | None = None  # pipelined: next step's
        self._next_cursor = 0  # ... groups, and the task cursor they started from
        self._next_curriculum: dict[str, Any] = {}  # ... and the curriculum then
        self.episodes_cut = 0

    def _fetch_policy(self) -> None:
        """Ray trainer: bring this process's policy (and optimizer) to rank 0's state."""
        if self.trainer is self.local_trainer:
            return
        state, optimizer, version = self.trainer.snapshot()
        self.policy.load_state_dict(state)
        self.local_trainer.grpo.optimizer.load_state_dict(optimizer)
        self.local_trainer.policy_version = version

    def current_weights(self) -> dict[str, torch.Tensor]:
        """The trainer's weights now (fetched from rank 0 on the ray backend)."""
        self._fetch_policy()
        return state_for_sync(self.policy)

    # -- rollouts ----------------------------------------------------------------------------
    async def _play_group(self, index: int, min_version: int = -1) -> Group[Sample] | None:
        played: PlayedGroup = await self.rollouts.play(index, min_version)
        task_id = self.tasks[index].id
        if played.dropped:
            self.episodes_cut += played.cut
            log.warning("rl.group_dropped", reason=played.dropped, task=task_id)
            return None
        samples = played.samples
        self.trajectories += len(samples)
        if self.hooks.reward is not None:
            for s in samples:
                s.reward = float(self.hooks.reward(s))
        if any(s.infra_fault for s in samples):
            log.warning("rl.group_dropped", reason="infrastructure fault", task=task_id)
            return None
        group = Group(samples=list(samples), policy_version=min(s.min_version for s in samples))
        if self.hooks.on_group is not None:
            self.hooks.on_group(group)
        return group

    async def _worker(self) -> None:
        ahead = self.rl.effective_max_ahead * self.rl.groups_per_step
        while True:
            # Groups leave the pipeline when the trainer takes them or drops them as stale. A
            # group started on weights already past the staleness bound (the weight store is
            # failing) would only be dropped: wait for the engine to catch up instead.
            while self.started - self._retired() >= ahead or (
                self.trainer.policy_version - self.rollouts.version > self.rl.max_staleness
            ):
                await asyncio.sleep(0.01)
            self.started += 1
            index = self._requeued.pop(0) if self._requeued else self._next_task_index()
            try:
                group = await self._play_group(
                    index, self.trainer.policy_version - self.rl.max_staleness
                )
            except WorkerLost as e:
                log.warning("rl.group_requeued", index=index, reason=str(e))
                self.requeued_total += 1
                self._requeued.append(index)
                self.started -= 1
                continue
            if group is None:
                self.started -= 1
                continue
            self.curriculum.record(self.tasks[index], [s.reward for s in group.samples])
            await self.buffer.put(group)

    def _next_task_index(self) -> int:
        """The next task at the cursor that the curriculum plays (the cursor passes the rest)."""
        while True:
            index = self.cursor
            self.cursor += 1
            if self.curriculum.admits(index, self.tasks[index]):
                return index

    def _retired(self) -> int:
        return self.buffer.stats.taken + self.buffer.stats.dropped_stale

    async def _republish(self) -> None:
        """Async mode: after a failed publish, retry it between trainer steps (the trainer may
        be waiting for data that only fresh weights give)."""
        while True:
            await self._publish_failed.wait()
            self._publish_failed.clear()
            await self._publish_pending()

    async def _publish_pending(self) -> None:
        """Retry a failed publish with backoff until it is out; each try publishes the
        trainer's current version, while its weights cannot change."""
        delay = RETRY_S
        while self.publisher.pending is not None:
            await asyncio.sleep(delay)
            delay = min(2 * delay, RETRY_MAX_S)
            async with self._trainer_busy:
                if self.publisher.pending is None:
                    break  # the trainer's own publish got it out while this one waited
                if await asyncio.to_thread(self._publish) is not None:
                    self.rollouts.published()

    def _publish(self) -> Any:
        """Publish the trainer's version (in a worker thread); None when the store failed
        (retried later)."""
        report = self.publisher.try_publish(self.trainer.policy_version, self.policy)
        if report is not None and self.hooks.on_publish is not None:
            self.hooks.on_publish(report.version, self.current_weights())
        return report

    # -- training ----------------------------------------------------------------------------
    def _informative(self, group: Group[Sample]) -> bool:
        """Whether a group's rewards differ (GRPO signal); if not it is counted, and a long run
        of such groups is reported with what the rewards were."""
        rewards = {s.reward for s in group.samples}
        run = self._no_signal_run  # [all rewarded, all unrewarded] groups in a row
        if len(rewards) > 1:
            run[:] = [0, 0]
            return True
        self.filtered += 1
        run[0 if rewards.pop() > 0 else 1] += 1
        if sum(run) % NO_SIGNAL_REPORT_EVERY == 0:
            log.warning(
                "rl.no_signal",
                groups_in_a_row=sum(run),
                all_rewarded=run[0],
                all_unrewarded=run[1],
                hint="every sample of these groups got the same reward, so the trainer waits for others: "
                "tasks too hard (or too easy) for this policy, or rl.group_size too small",
            )
        return False

    async def _take_groups(self) -> list[Group[Sample]]:
        if self.rl.mode == "sync":
            return await self._play_step()
        if self.rl.mode == "pipelined":
            return await self._take_pipelined()
        groups: list[Group[Sample]] = []
        while len(groups) < self.rl.groups_per_step:
            for g in await self.buffer.take(1, self.trainer.policy_version):
                if self._informative(g):
                    groups.append(g)
        return groups

    async def _play_step(self) -> list[Group[Sample]]:
        """One step's informative groups, played from the task cursor on the engines' current
        weights (sync and pipelined modes: a group's place in the run fixes its samples)."""
        groups: list[Group[Sample]] = []
        while len(groups) < self.rl.groups_per_step:
            need = self.rl.groups_per_step - len(groups)
            indices = [self._next_task_index() for _ in range(need)]
            played = await asyncio.gather(*(self._play_sync(i) for i in indices))
            for index, group in zip(indices, played, strict=True):  # recorded in task order
                if group is not None:
                    self.curriculum.record(self.tasks[index], [s.reward for s in group.samples])
            groups += [g for g in played if g is not None and self._informative(g)]
        return groups

    async def _take_pipelined(self) -> list[Group[Sample]]:
        """This step's groups (played during the last step's training), then the engines move
        to the trainer's version and start the next step's groups while this one trains."""
        if self._next is None:
            self._next_cursor, self._next_curriculum = self.cursor, self.curriculum.state()
            self._next = asyncio.create_task(self._play_step())
        groups = await self._next
        self._next = None
        await self._publish_pending()  # no group on a version that is not out
        await self.rollouts.sync_to(self.trainer.policy_version)
        if self.step + 1 < self.rl.steps:
            self._next_cursor, self._next_curriculum = self.cursor, self.curriculum.state()
            self._next = asyncio.create_task(self._play_step())
        return groups

    def _count_taken(self, groups: list[Group[Sample]]) -> None:
        """Sync and pipelined modes bypass the buffer: count their groups' staleness here."""
        stats = self.buffer.stats
        for g in groups:
            lag = self.trainer.policy_version - g.policy_version
            stats.taken += 1
            stats.staleness_histogram[lag] = stats.staleness_histogram.get(lag, 0) + 1

    async def _play_sync(self, index: int) -> Group[Sample] | None:
        """Sync mode: a group lost with its worker is played again at once (same index, same
        weights, so the same samples)."""
        while True:
            try:
                return await self._play_group(index)
            except WorkerLost as e:
                log.warning("rl.group_requeued", index=index, reason=str(e))
                self.requeued_total += 1

    def _train(self, groups: list[Group[Sample]]) -> tuple[dict[str, Any], Any]:
        """The trainer step and the publish of its version (runs in a worker thread)."""
        t0 = time.perf_counter()
        stats = self.trainer.step([g.samples for g in groups])
        stats["train_s"] = time.perf_counter() - t0
        report = None
        if stats.get("step_applied"):
            report = self._publish()
            stats["publish_failed"] = report is None
        return stats, report

    def _checkpoint(self) -> None:
        self._fetch_policy()
        self.checkpoints.save(
            self.step,
            model=self.policy,
            optimizer=self.local_trainer.grpo.optimizer,
            policy_version=self.trainer.policy_version,
            # pipelined: the next step's groups in flight are played again after a resume
            task_cursor=self._next_cursor if self._next is not None else self.cursor,
            extra={
                "stream": self.stream,
                "curriculum": (
                    self._next_curriculum if self._next is not None else self.curriculum.state()
                ),
            },
        )

    async def _run(self) -> RunSummary:
        t_start = time.perf_counter()
        rollout_tasks = await self.rollouts.start(follow=self.rl.mode == "async")
        # delta-sync's compiled kernels get ready while the first groups play, not inside the
        # first publish or the engine's first pause (compiled once per machine, then loaded)
        widths = sorted({t.element_size() for t in self.policy.state_dict().values()})
        own = [asyncio.create_task(asyncio.to_thread(warm_up, widths))]
        if self.rl.mode == "async":
            own.append(asyncio.create_task(self._republish()))
            own += [asyncio.create_task(self._worker()) for _ in range(self.rl.rollout_workers)]
        background = [*rollout_tasks, *own]
        bar = StepProgress(self.rl.steps, self.step, enabled=self.progress)
        last: dict[str, Any] = {}
        rollout_t0, rollout_tok0 = time.perf_counter(), (await self.rollouts.stats()).tokens_sampled
        try:
            while self.step < self.rl.steps:
                if self.max_wall_s is not None and time.perf_counter() - t_start > self.max_wall_s:
                    log.info("rl.wall_limit", step=self.step, seconds=round(self.max_wall_s, 1))
                    break
                t0 = time.perf_counter()
                budget = None
                if self.max_wall_s is not None:
                    budget = max(self.max_wall_s - (t0 - t_start), 0.0)
                try:
                    # A policy that never varies its reward yields no informative group: the
                    # wall-clock budget must also bound the wait for data.
                    groups = await asyncio.wait_for(
                        self._take_groups_checked(background), timeout=budget
                    )
                except TimeoutError:
                    log.info(
                        "rl.wall_limit",
                        step=self.step,
                        waiting_for="informative groups",
                        filtered=self.filtered,
                    )
                    break
                t_wait = time.perf_counter() - t0  # the trainer idles while it waits for data
                if self.rl.mode != "async":
                    self._count_taken(groups)
                async with self._trainer_busy:
                    stats, report = await asyncio.to_thread(self._train, groups)
                self.wait_s += t_wait
                self.busy_s += stats["train_s"]
                if report is not None and self.rl.mode == "async":
                    self.rollouts.published()
                if stats.get("publish_failed"):
                    self._publish_failed.set()
                stats = step_metrics(
                    groups,
                    stats,
                    report,
                    t_wait,
                    await self.rollouts.stats(),
                    self.buffer.stats,
                    {
                        "groups_filtered_equal": self.filtered,
                        "tasks_skipped": self.curriculum.skipped,
                        "trajectories": self.trajectories,
                        "publish_failures": self.publisher.failures,
                        "episodes_cut": self.episodes_cut,
                        "groups_requeued": self.requeued_total,
                    },
                )
                now = time.perf_counter()
                stats["rollout_tokens_per_s"] = (
                    stats["rollout_tokens_sampled"] - rollout_tok0
                ) / max(now - rollout_t0, 1e-9)
                stats["elapsed_s"] = now - t_start
                if self.rl.mode == "sync" and stats.get("step_applied"):
                    await self._publish_pending()  # no rollout before the version is out
                    await self.rollouts.sync_to(self.trainer.policy_version)
                self.metrics.log(self.step, stats)
                last = stats
                log_step(self.step, stats)
                if self.hooks.on_step is not None:
                    outcome = self.hooks.on_step(self.step, stats)
                    if inspect.isawaitable(outcome):
                        await outcome  # e.g. a test that resizes the worker pool
                self.step += 1
                bar.advance(stats)
                if self.step % self.rl.checkpoint_every == 0 or self.step == self.rl.steps:
                    self._checkpoint()
        finally:
            bar.close()
            if self._next is not None:
                own.append(self._next)
            await cancel_and_wait(own)
            await self.buffer.close()
            final = await self.rollouts.stats()
            t_end = time.perf_counter()
            await self.rollouts.close()
            self.metrics.close()
            if self.trainer is not self.local_trainer:
                self._fetch_policy()  # the run's result lives in this process's policy
                self.trainer.close()
            else:
                self.publisher.close()  # its encode and upload threads
            if self._own_ray:
                import ray

                ray.shutdown()
        return RunSummary(
            steps_done=self.step,
            policy_version=self.trainer.policy_version,
            wall_s=time.perf_counter() - t_start,
            trajectories=self.trajectories,
            trainer_busy_s=self.busy_s,
            trainer_wait_s=self.wait_s,
            dropped_stale=self.buffer.stats.dropped_stale,
            filtered_equal=self.filtered,
            staleness_histogram=dict(self.buffer.stats.staleness_histogram),
            publish_bytes=[r.step_bytes for r in self.publisher.reports],
            ratios=[r.ratio for r in self.publisher.reports],
            pause_s=final.pause_s,
            prepare_s=final.prepare_s,
            last_metrics=last,
            engine_busy_s=final.busy_s,
            engine_s=final.workers * (t_end - rollout_t0),
        )

    async def _take_groups_checked(
        self, background: list[asyncio.Task[Any]]
    ) -> list[Group[Sample]]:
        """Take groups, surfacing a crashed engine or worker instead of waiting forever."""
        take = asyncio.create_task(self._take_groups())
        while True:
            try:
                done, _ = await asyncio.wait(
                    [take, *background], return_when=asyncio.FIRST_COMPLETED
                )
            except asyncio.CancelledError:
                await cancel_and_wait([take])
                raise
            if take in done:
                return take.result()
            for task in done:
                if task.exception() is not None:
                    take.cancel()
                    raise task.exception()  # type: ignore[misc]
            background[:] = [t for t in background if t not in done]

    def run(self) -> RunSummary:
        """Run (or resume) to ``rl.steps`` steps; returns the run's summary."""
        with batch_invariant(self.engine_cfg.deterministic), torch_threads(self.rl.torch_threads):
            self._setup()
            if self.hooks.on_engine_update is not None:
                if not isinstance(self.rollouts, LocalRollouts):
                    raise ValueError("RunHooks.on_engine_update needs the local backend")
                self.rollouts.engine.on_apply = self.hooks.on_engine_update
            return asyncio.run(self._run())
