"""The RL loop: take a step's groups, train, publish, log, checkpoint; to ``rl.steps``.

`RLRun` owns the policy version: it hands it to the trainer step and to every publish, and
counts an applied step; no other place writes it. Where the groups come from is the
schedule's business (`schedule`), the rule of how stale they may be `staleness`'s, where the
engines and the trainer live the backend's (built by the factory the run is given). The loop
imports only their protocols, the wire types and the config.

Checkpoints every ``checkpoint_every`` steps hold the weights, the optimizer, the policy
version, the task cursor (with the curriculum's and the category balance's running state)
and the RNGs; a run killed at any instant (SIGKILL included) resumes from the last one
with no repeated or skipped step, on a fresh weight stream. A run
asked to stop (`RunHooks.stop_signals`) finishes the step in training or abandons the one
waiting for groups, and checkpoints the last finished step before it returns.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from tandem.orchestrator.artifacts.checkpoint import CheckpointManager
from tandem.orchestrator.artifacts.metrics import MetricsLog
from tandem.orchestrator.config import RLConfig
from tandem.orchestrator.protocols import (
    Backend,
    BackendFactory,
    BackendStart,
    TaskCursor,
    Trainer,
)
from tandem.orchestrator.rl.category_balance import CategoryBalance
from tandem.orchestrator.rl.groups import GroupSource
from tandem.orchestrator.rl.hooks import RunHooks
from tandem.orchestrator.rl.publishing import Publishing
from tandem.orchestrator.rl.schedule import Schedule, ScheduleContext, make_schedule
from tandem.orchestrator.rl.staleness import StalenessRule, StalenessStats
from tandem.orchestrator.rl.step_log import StepProgress, log_step
from tandem.orchestrator.rl.summary import RunSummary, step_metrics
from tandem.orchestrator.runtime.cancel import cancel_and_wait
from tandem.orchestrator.runtime.threads import SpareCores, torch_threads
from tandem.orchestrator.wire import Group

log = structlog.get_logger()

SIGNAL_ECHO_S = 2.0
"""A stop signal repeated within this many seconds is the same request, not a second one."""


class RLRun:
    """One RL run in ``run_dir`` (resumed from its checkpoints when there are some).

    ``make_backend`` builds the engines, the trainer and the weight sink for the version
    and weight stream the run starts from; ``cursor`` picks each group's task.
    """

    def __init__(
        self,
        make_backend: BackendFactory,
        cursor: TaskCursor,
        *,
        rl: RLConfig,
        run_dir: str | Path,
        hooks: RunHooks | None = None,
        progress: bool = False,
        max_wall_s: float | None = None,
        train_failed_groups: bool = False,
    ) -> None:
        self.make_backend = make_backend
        self.train_failed_groups = train_failed_groups
        self.cursor = cursor
        self.rl = rl
        self.run_dir = Path(run_dir)
        self.hooks = hooks or RunHooks()
        self.progress = progress
        self.max_wall_s = max_wall_s
        self.checkpoints = CheckpointManager(self.run_dir / "checkpoints", keep=rl.keep_checkpoints)
        balance = rl.category_balance
        self.balance = CategoryBalance(balance) if balance.enabled else None
        self.step = self.version = self.stream = 0
        self.busy_s = self.wait_s = 0.0
        self.signal_at = 0.0  # when the first stop signal came
        self.cores: SpareCores | None = None

    def run(self) -> RunSummary:
        """Run (or resume) to ``rl.steps`` steps; returns the run's summary."""
        with torch_threads(self.rl.torch_threads):
            backend = self._setup()
            return asyncio.run(self._run(backend))

    # -- setup -------------------------------------------------------------------------------
    def _setup(self) -> Backend:
        start = BackendStart(version=0, stream=0, on_engine_update=self.hooks.on_engine_update)
        if self.checkpoints.latest_step() is not None:
            ckpt = self.checkpoints.load()
            meta = ckpt.meta
            self.step, self.version = meta.step, meta.policy_version
            self.stream = int(meta.extra.get("stream", 0)) + 1
            self.cursor.load(
                {"cursor": meta.task_cursor, "curriculum": meta.extra.get("curriculum", {})}
            )
            if self.balance is not None:
                self.balance.load(meta.extra.get("category_balance", {}))
            start = BackendStart(
                version=self.version,
                stream=self.stream,
                resume=ckpt,
                on_engine_update=self.hooks.on_engine_update,
            )
            log.info("rl.resumed", step=self.step, policy_version=self.version, stream=self.stream)
        return self.make_backend(start)

    # -- one step ----------------------------------------------------------------------------
    def _train(self, trainer: Trainer, groups: list[Group]) -> tuple[dict[str, Any], Any]:
        """The trainer step and the publish of its version (in a worker thread)."""
        t0 = time.perf_counter()
        try:
            stats = trainer.step([g.samples for g in groups], self.version)
        finally:
            alone = self.cores.end_step() if self.cores is not None else None
        stats["train_s"] = time.perf_counter() - t0
        if alone is not None:
            stats["trainer_alone_s"] = alone
        report = None
        if stats.get("step_applied"):
            self.version += 1
            report = self.publishing.publish()
            stats["publish_failed"] = report is None
        stats["policy_version"] = self.version
        return stats, report

    async def _take_checked(
        self,
        schedule: Schedule,
        step: int,
        background: list[asyncio.Task[Any]],
        stop: asyncio.Event,
    ) -> list[Group] | None:
        """The step's groups, surfacing a crashed engine or worker instead of waiting forever;
        None when the run was asked to stop first (the step is abandoned)."""
        take = asyncio.create_task(schedule.take(step))
        stopping = asyncio.create_task(stop.wait())
        while True:
            try:
                done, _ = await asyncio.wait(
                    [take, stopping, *background], return_when=asyncio.FIRST_COMPLETED
                )
            except asyncio.CancelledError:
                await cancel_and_wait([take, stopping])
                raise
            if take in done:
                await cancel_and_wait([stopping])
                return take.result()
            if stopping in done:
                await cancel_and_wait([take])
                return None
            for task in done:
                if task.exception() is not None:
                    await cancel_and_wait([take, stopping])
                    raise task.exception()  # type: ignore[misc]
            background[:] = [t for t in background if t not in done]

    def _checkpoint(self, backend: Backend, schedule: Schedule) -> None:
        model_state, optimizer_state = backend.trainer.checkpoint_state()
        cursor = schedule.cursor_state()
        self.checkpoints.save(
            self.step,
            model_state=model_state,
            optimizer_state=optimizer_state,
            policy_version=self.version,
            task_cursor=cursor["cursor"],
            extra={
                "stream": self.stream,
                "curriculum": cursor["curriculum"],
                **({} if self.balance is None else {"category_balance": self.balance.state()}),
            },
        )

    def _catch_signals(self, stop: asyncio.Event) -> list[int]:
        """Set ``stop`` on the first of `RunHooks.stop_signals`; the same signal again is
        handled as if the run did not catch it (quits at once). Returns the list the signal
        received is appended to.

        A copy arriving within `SIGNAL_ECHO_S` is the same request: Ctrl-C reaches both
        ``uv run`` and this process, and uv forwards it once more."""
        loop = asyncio.get_running_loop()
        received: list[int] = []
        first: list[float] = []

        def on_signal(sig: int) -> None:
            if first:  # a signal already asked to stop (``stop`` may also be set otherwise)
                if time.monotonic() - first[0] < SIGNAL_ECHO_S:
                    return
                loop.remove_signal_handler(sig)
                os.kill(os.getpid(), sig)
                return
            first.append(time.monotonic())
            self.signal_at = first[0]
            received.append(sig)
            stop.set()
            log.warning(
                "rl.stopping",
                signal=signal.Signals(sig).name,
                step=self.step,
                hint="the step in training finishes, then a checkpoint; again to quit at once",
            )

        for sig in self.hooks.stop_signals:
            loop.add_signal_handler(sig, on_signal, sig)
        return received

    def _share_cores(self, trainer: Trainer, source: GroupSource) -> Callable[[], None]:
        """With ``rl.trainer_threads_alone``, the trainer (in this process with the local and
        process backends: its model is here) steps on that many threads while no group is
        being played."""
        if not self.rl.trainer_threads_alone:
            return lambda: None
        model = getattr(trainer, "model", None)
        if model is None:
            raise ValueError(
                f"rl.trainer_threads_alone: the trainer {type(trainer).__name__} does not run "
                "its model in this process; set it to 0"
            )
        self.cores = SpareCores(
            self.rl.torch_threads, self.rl.trainer_threads_alone, lambda: source.idle
        )
        return self.cores.attach(model)

    # -- the run -----------------------------------------------------------------------------
    async def _run(self, backend: Backend) -> RunSummary:
        t_start = time.perf_counter()
        rollouts = backend.rollouts
        self.publishing = Publishing(
            backend.sink, backend.trainer, rollouts, lambda: self.version, self.hooks
        )
        source = GroupSource(
            rollouts,
            self.cursor,
            self.hooks,
            self.train_failed_groups,
            self.rl.tool_error_penalty,
            self.balance,
        )
        detach = self._share_cores(backend.trainer, source)
        staleness = StalenessStats()
        schedule = make_schedule(
            ScheduleContext(
                rl=self.rl,
                source=source,
                rollouts=rollouts,
                publishing=self.publishing,
                rule=StalenessRule.for_run(self.rl),
                stats=staleness,
                version=lambda: self.version,
            )
        )
        metrics = MetricsLog(self.run_dir / "metrics.jsonl", resume_from_step=self.step)
        own: list[asyncio.Task[Any]] = []
        bar = StepProgress(self.rl.steps, self.step, enabled=self.progress)
        last: dict[str, Any] = {}
        rollout_t0 = time.perf_counter()
        stop = asyncio.Event()
        stopped_by = self._catch_signals(stop)
        source.signal.give_up_after(self.rl.max_equal_groups, stop.set)
        try:
            background = await rollouts.start(follow=self.rl.mode == "async")
            own = schedule.start()
            background += own
            rollout_t0 = time.perf_counter()
            rollout_tok0 = (await rollouts.stats()).tokens_sampled
            while self.step < self.rl.steps and not stop.is_set():
                t0 = time.perf_counter()
                budget = None
                if self.max_wall_s is not None:
                    budget = self.max_wall_s - (t0 - t_start)
                    if budget < 0:
                        log.info("rl.wall_limit", step=self.step, seconds=round(self.max_wall_s, 1))
                        break
                try:
                    # A policy that never varies its reward yields no informative group: the
                    # wall-clock budget must also bound the wait for data.
                    groups = await asyncio.wait_for(
                        self._take_checked(schedule, self.step, background, stop), timeout=budget
                    )
                except TimeoutError:
                    log.info(
                        "rl.wall_limit",
                        step=self.step,
                        waiting_for="informative groups",
                        filtered=source.signal.filtered,
                    )
                    break
                if groups is None:
                    log.info("rl.step_abandoned", step=self.step, waiting_for="groups")
                    break
                t_wait = time.perf_counter() - t0  # the trainer idles while it waits for data
                async with self.publishing.busy:
                    stats, report = await asyncio.to_thread(self._train, backend.trainer, groups)
                self.wait_s += t_wait
                self.busy_s += stats["train_s"]
                stats = step_metrics(
                    groups,
                    stats,
                    report,
                    t_wait,
                    await rollouts.stats(),
                    staleness,
                    {
                        "groups_filtered_equal": source.signal.filtered,
                        "tasks_skipped": self.cursor.skipped,
                        "trajectories": source.trajectories,
                        "publish_failures": backend.sink.failures,
                        "episodes_cut": source.episodes_cut,
                        "groups_requeued": source.requeued,
                    },
                )
                stats["category_reward"] = source.categories.take()
                if source.balance is not None:
                    stats["category_weight"] = source.balance.weights()
                now = time.perf_counter()
                stats["rollout_tokens_per_s"] = (
                    stats["rollout_tokens_sampled"] - rollout_tok0
                ) / max(now - rollout_t0, 1e-9)
                stats["elapsed_s"] = now - t_start
                await schedule.after_step(report is not None, bool(stats.get("publish_failed")))
                metrics.log(self.step, stats)
                last = stats
                log_step(self.step, stats)
                if self.hooks.on_step is not None:
                    outcome = self.hooks.on_step(self.step, stats)
                    if inspect.isawaitable(outcome):
                        await outcome  # e.g. a test that resizes the worker pool
                self.step += 1
                bar.advance(stats)
                if self.step % self.rl.checkpoint_every == 0 or self.step == self.rl.steps:
                    self._checkpoint(backend, schedule)
            if stop.is_set() and self.step > (self.checkpoints.latest_step() or 0):
                self._checkpoint(backend, schedule)
        finally:
            bar.close()
            detach()
            await cancel_and_wait(own)
            await schedule.close()
            final = await rollouts.stats()
            t_end = time.perf_counter()
            await backend.close()
            metrics.close()
            # the handlers stay while the run closes, and until an echo of the stop signal
            # (uv forwards Ctrl-C once more) has had its time: it must not find the default
            # handler (a KeyboardInterrupt in place of a clean stop)
            if stopped_by:
                await asyncio.sleep(max(0.0, self.signal_at + SIGNAL_ECHO_S - time.monotonic()))
            for sig in self.hooks.stop_signals:
                asyncio.get_running_loop().remove_signal_handler(sig)
        if stopped_by and self.hooks.on_stop is not None:
            self.hooks.on_stop(stopped_by[0], self.step)
        return RunSummary(
            steps_done=self.step,
            policy_version=self.version,
            wall_s=time.perf_counter() - t_start,
            trajectories=source.trajectories,
            trainer_busy_s=self.busy_s,
            trainer_wait_s=self.wait_s,
            dropped_stale=staleness.dropped_stale,
            filtered_equal=source.signal.filtered,
            staleness_histogram=dict(staleness.staleness_histogram),
            publish_bytes=[r.step_bytes for r in backend.sink.reports],
            ratios=[r.ratio for r in backend.sink.reports],
            pause_s=final.pause_s,
            prepare_s=final.prepare_s,
            last_metrics=last,
            engine_busy_s=final.busy_s,
            engine_s=final.workers * (t_end - rollout_t0),
            category_reward=source.categories.totals(),
        )
