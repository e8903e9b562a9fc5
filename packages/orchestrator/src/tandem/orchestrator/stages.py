"""The stages: mid-train a fresh policy, evaluate a policy, improve it with RL.

Each reads the `RunConfig` and leaves its artefacts in the run's directory
(``run.output_dir/run.name``): ``midtrained/`` (HF weights) and ``midtrain_metrics.jsonl``;
``rl/`` (metrics, checkpoints, weight streams). The app's commands call these; so can
anyone with a config.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import structlog

from tandem.agent_env import Task
from tandem.moe_determinism import MoETransformer
from tandem.orchestrator.artifacts.metrics import MetricsLog
from tandem.orchestrator.backends import build_backend
from tandem.orchestrator.config import ConfigValueError, RunConfig
from tandem.orchestrator.eval.evaluate import progress_log
from tandem.orchestrator.eval.on_vllm import play_on_vllm
from tandem.orchestrator.eval.passk import EvalResult, summarize
from tandem.orchestrator.eval.replicas import play_on_replicas
from tandem.orchestrator.inference.formats import chat_format_for
from tandem.orchestrator.midtrain.corpus import code_windows
from tandem.orchestrator.midtrain.trainer import Midtrainer, eval_loss
from tandem.orchestrator.midtrain.transcripts import oracle_transcripts
from tandem.orchestrator.policy import build_model, clone_model, save_policy
from tandem.orchestrator.rl.hooks import RunHooks
from tandem.orchestrator.rl.loop import RLRun
from tandem.orchestrator.rl.summary import RunSummary
from tandem.orchestrator.rollout.compaction import check_prompts
from tandem.orchestrator.rollout.curriculum import CuratedCursor
from tandem.orchestrator.rollout.tasks import TaskSource, task_category

log = structlog.get_logger()


PROMPTS_CHECKED = 64
"""Training tasks whose prompts are checked against the window before RL starts."""


def midtrain_policy(
    config: RunConfig,
    *,
    run_dir: Path | None = None,
    progress: Callable[[int, float], None] | None = None,
    deadline: float | None = None,
) -> tuple[MoETransformer, dict[str, Any]]:
    """Mid-train a fresh model on code and oracle transcripts; save it as HF weights in
    ``run_dir/midtrained`` (default: the run's directory). ``deadline``: a
    `time.perf_counter` value after which no further step starts."""
    run_dir = run_dir or config.run_dir
    mid, env, seed = config.midtrain, config.env, config.run.seed
    max_obs = config.episode.max_observation_chars
    chat = chat_format_for(config.model.path)
    tok = chat.tok
    model = build_model(config.model, tok, seed=mid.init_seed)
    t0 = time.perf_counter()
    windows = functools.partial(code_windows, tok, window=mid.window, seed=seed, eos_id=chat.eos_id)
    code = []
    if mid.transcript_fraction < 1:
        code = list(windows(max_bytes=mid.code_bytes))
    held_code = list(windows(max_bytes=64 * mid.window, split="held_out"))[:16]
    train_tasks = TaskSource(config.tasks, config.tasks.train_seed).take(0, mid.transcripts)
    # The oracle needs its whole script (more calls than the policy's turn budget may allow).
    oracle_env = msgspec.structs.replace(env, max_turns=max(env.max_turns, 12))
    transcripts = oracle_transcripts(
        train_tasks,
        oracle_env,
        chat,
        max_observation_chars=max_obs,
        skip_tools=mid.skip_tools,
        edit_min_chars=mid.edit_min_chars,
        max_turns=env.max_turns,
        detour_fraction=mid.detour_fraction,
        cache=run_dir / "cache" / "oracle_transcripts.json",
        compaction=config.episode.compaction,
        max_len=config.engine.max_len,
    )
    n_played = len(transcripts)
    max_len = config.engine.max_len
    transcripts = [(ids, mask) for ids, mask in transcripts if len(ids) <= max_len]
    if not transcripts and mid.transcript_fraction > 0:
        why = (
            f"none fits the policy's turn budget env.max_turns = {env.max_turns}"
            if n_played == 0
            else f"{n_played} fit env.max_turns, none engine.max_len = {max_len} tokens"
        )
        raise ConfigValueError(
            f"midtrain.transcript_fraction: {mid.transcript_fraction} needs oracle transcripts, "
            f"but of the transcripts of {mid.transcripts} training tasks {why}; raise it, or "
            "set midtrain.transcript_fraction = 0"
        )
    if mid.transcript_loss == "all":
        transcripts = [(ids, [1] * len(ids)) for ids, _ in transcripts]
    prep_s = time.perf_counter() - t0
    log.info(
        "midtrain.data",
        code_windows=len(code),
        transcripts=len(transcripts),
        transcript_tokens=sum(len(i) for i, _ in transcripts),
        seconds=round(prep_s, 1),
    )
    pad = chat.pad_id
    trainer = Midtrainer(model, mid, code=code, transcripts=transcripts, pad_id=pad, seed=seed)
    with MetricsLog(run_dir / "midtrain_metrics.jsonl") as metrics:
        info = trainer.run(metrics, progress=progress, deadline=deadline)
    held = [(w.tolist(), [1] * len(w)) for w in held_code]
    info["held_out_code_loss"] = eval_loss(model, held, pad) if held else float("nan")
    info["data_seconds"] = prep_s
    info["transcripts"] = len(transcripts)
    info["params"] = sum(p.numel() for p in model.parameters())
    save_policy(model, run_dir / "midtrained", stage="midtrain", steps=info["steps"])
    log.info(
        "midtrain.done", **{k: round(v, 4) if isinstance(v, float) else v for k, v in info.items()}
    )
    return model, info


def held_out_tasks(
    model: MoETransformer, config: RunConfig, n_tasks: int | None = None
) -> list[Task]:
    """The first ``n_tasks`` (default ``eval.tasks``) held-out tasks (``tasks.eval_seed``),
    their prompts checked against the engine's window."""
    held_out = TaskSource(config.tasks, config.tasks.eval_seed).take(
        0, n_tasks or config.eval.tasks
    )
    check_prompts(
        chat_format_for(model.config.path), held_out, config.env, config.engine.max_len,
        config.episode.compaction,
    )  # fmt: skip
    return held_out


def evaluate_policy(
    model: MoETransformer,
    config: RunConfig,
    *,
    n_tasks: int | None = None,
    samples: int | None = None,
    held_out: list[Task] | None = None,
    when_idle: bool = False,
) -> EvalResult:
    """pass@k (``eval.ks``) of ``model`` on ``eval.tasks`` held-out tasks
    (``tasks.eval_seed``; or the checked ``held_out``), ``eval.samples`` each, played by
    ``eval.engines`` embedded engines (worker processes when more than one; 0: one per
    core), or by vLLM servers (``engine.kind = "vllm"``). ``when_idle``: the worker
    processes run only on idle cores (`play_on_replicas`)."""
    held_out = held_out if held_out is not None else held_out_tasks(model, config, n_tasks)
    n_tasks = len(held_out)
    samples = samples or config.eval.samples
    t0 = time.perf_counter()
    if config.engine.kind == "vllm":
        per_task = play_on_vllm(
            model,
            config,
            held_out,
            samples=samples,
            log_dir=config.run_dir,
            on_sample=progress_log(n_tasks * samples),
        )
    else:
        per_task = play_on_replicas(
            model,
            config,
            held_out,
            samples=samples,
            replicas=eval_replicas(config),
            on_sample=progress_log(n_tasks * samples),
            when_idle=when_idle,
        )
    ks = tuple(k for k in config.eval.ks if k <= samples)
    result = summarize(per_task, ks, [task_category(t) for t in held_out])
    log.info(
        "eval.done",
        tasks=result.tasks,
        samples=result.samples_per_task,
        pass_at={str(k): round(v, 4) for k, v in result.pass_at.items()},
        format_error_rate=round(result.format_error_rate, 3),
        seconds=round(time.perf_counter() - t0, 1),
    )
    return result


def eval_replicas(config: RunConfig) -> int:
    """Engine processes an evaluation plays on (``eval.engines``; 0: one per core)."""
    return config.eval.engines or os.cpu_count() or 1


class EvalBeside:
    """An evaluation of a copy of a policy, played by engine processes that run only on idle
    cores while this process goes on (the demo's first evaluation, beside its RL).

    RL leaves a core idle for part of its time (its trainer waits for rollouts about a
    fifth of it); engine processes under `run_when_idle` take those moments and nothing
    else, so most of the evaluation costs no wall time. The episodes are seeded, so the
    result is the one the evaluation gives alone. The held-out prompts are checked before
    it starts."""

    def __init__(self, model: MoETransformer, config: RunConfig) -> None:
        held_out = held_out_tasks(model, config)
        copy = clone_model(model)  # the caller goes on training the original
        self.seconds = 0.0
        self._result: EvalResult | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(copy, config, held_out), name="tandem-eval-beside", daemon=True
        )
        self._thread.start()

    @staticmethod
    def possible(config: RunConfig) -> bool:
        """Whether ``config``'s evaluation plays in engine processes (not in this process,
        whose Python the other stage needs, nor on vLLM servers)."""
        return config.engine.kind != "vllm" and eval_replicas(config) > 1

    def _run(self, model: MoETransformer, config: RunConfig, held_out: list[Task]) -> None:
        t0 = time.perf_counter()
        try:
            self._result = evaluate_policy(model, config, held_out=held_out, when_idle=True)
        except BaseException as e:  # handed to the caller of `result`
            self._error = e
        finally:
            self.seconds = time.perf_counter() - t0

    def running(self) -> bool:
        """Whether the evaluation is still playing (`result` would wait)."""
        return self._thread.is_alive()

    def result(self) -> EvalResult:
        """The evaluation's result, once it is done; what it raised, raised here."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


def check_rl_engine(config: RunConfig) -> None:
    """Raise `ConfigValueError` before any work for an engine RL cannot run on: vLLM
    servers serve the ``local`` backend's rollouts (one engine over ``engine.vllm.urls``, or
    a server started on loopback), and on the ``ray`` backend each rollout actor starts a
    server of its own; servers given by URL would be shared by actors that each follow
    the weight stream, so the ``ray`` backend refuses them; the ``process`` backend's child
    runs an embedded engine only."""
    if config.engine.kind == "vllm" and config.rl.backend == "ray" and config.engine.vllm.urls:
        raise ConfigValueError(
            "engine.vllm.urls with rl.backend = 'ray': each rollout actor starts and updates "
            "a vLLM server of its own; give servers by URL with rl.backend = 'local'"
        )
    if config.engine.kind == "vllm" and config.rl.backend == "process":
        raise ConfigValueError(
            "engine.kind = 'vllm' with rl.backend = 'process': 'process' runs an embedded "
            "engine in a child process, and vLLM servers run apart already; use 'local'"
        )


def reinforce(
    model: MoETransformer,
    config: RunConfig,
    *,
    run_dir: Path | None = None,
    task_offset: int | None = None,
    progress: bool = False,
    max_wall_s: float | None = None,
    hooks: RunHooks | None = None,
) -> RunSummary:
    """The RL stage on ``model`` (trained in place) in ``run_dir`` (default: the run's
    ``rl/``), on training tasks ``task_offset..`` of ``tasks.train_seed`` (default: those
    after the ones mid-training's transcripts used). Resumes from the checkpoints there."""
    check_rl_engine(config)
    run_dir = run_dir or config.run_dir / "rl"
    if task_offset is None:
        task_offset = config.midtrain.transcripts
    tasks = TaskSource(config.tasks, config.tasks.train_seed, offset=task_offset)
    check_prompts(
        chat_format_for(model.config.path), tasks.take(0, PROMPTS_CHECKED), config.env,
        config.engine.max_len, config.episode.compaction,
    )  # fmt: skip
    hooks = hooks or RunHooks()
    make_backend = functools.partial(
        build_backend, policy=model, config=config, tasks=tasks, run_dir=Path(run_dir)
    )
    train_failed = config.trainer.loss.failed_group_advantage != 0
    run = RLRun(
        make_backend,
        CuratedCursor(tasks, config.rl.curriculum, config.run.seed, train_failed),
        rl=config.rl,
        run_dir=run_dir,
        hooks=hooks,
        progress=progress,
        max_wall_s=max_wall_s,
        train_failed_groups=train_failed,
    )
    return run.run()
