"""The stages as functions the app calls: mid-train, evaluate, RL.

Each takes the config sections it needs and a run directory, and leaves its artefacts there
(``midtrained/`` HF weights, ``midtrain_metrics.jsonl``, ``rl/`` metrics, checkpoints and
weight streams).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import structlog

from tandem.moe_determinism import MoETransformer, batch_invariant
from tandem.orchestrator.chat_format import ChatFormat
from tandem.orchestrator.config import (
    ConfigValueError,
    EngineConfig,
    EnvSettings,
    MidtrainConfig,
    ModelConfig,
    RLConfig,
    TaskConfig,
    TrainerConfig,
)
from tandem.orchestrator.corpus import code_windows
from tandem.orchestrator.engine import InferenceEngine
from tandem.orchestrator.evaluate import EvalResult, evaluate
from tandem.orchestrator.metrics import MetricsLog
from tandem.orchestrator.midtrain import Midtrainer, eval_loss
from tandem.orchestrator.policy import build_model, clone_model, save_policy
from tandem.orchestrator.rl import RLRun, RunHooks, RunSummary
from tandem.orchestrator.server import EngineServer
from tandem.orchestrator.tasks import TaskSource, env_config
from tandem.orchestrator.transcripts import oracle_transcripts

log = structlog.get_logger()


def midtrain(
    *,
    model_cfg: ModelConfig,
    mid: MidtrainConfig,
    tasks: TaskConfig,
    env: EnvSettings,
    engine: EngineConfig,
    run_dir: Path,
    seed: int,
    progress: Callable[[int, float], None] | None = None,
    deadline: float | None = None,
) -> tuple[MoETransformer, dict[str, Any]]:
    """Mid-train a fresh model on stdlib code + oracle transcripts; save it as HF weights."""
    chat = ChatFormat()
    tok = chat.tok
    t0 = time.perf_counter()
    code = []
    if mid.transcript_fraction < 1:
        code = list(code_windows(tok, window=mid.window, seed=seed, max_bytes=mid.code_bytes))
    held_code = list(
        code_windows(tok, window=mid.window, seed=seed, max_bytes=64 * mid.window, split="held_out")
    )[:16]
    source = TaskSource(tasks, tasks.train_seed)
    train_tasks = source.take(0, mid.transcripts)
    # The oracle needs its whole script (more calls than the policy's turn budget may allow).
    oracle_env = msgspec.structs.replace(env_config(env), max_turns=max(env.max_turns, 12))
    transcripts = oracle_transcripts(
        train_tasks,
        oracle_env,
        chat,
        max_observation_chars=env.max_observation_chars,
        skip_tools=mid.skip_tools,
        edit_min_chars=mid.edit_min_chars,
        max_turns=env.max_turns,
        cache=run_dir / "cache" / "oracle_transcripts.json",
    )
    n_played = len(transcripts)
    transcripts = [(ids, mask) for ids, mask in transcripts if len(ids) <= engine.max_len]
    if not transcripts and mid.transcript_fraction > 0:
        why = (
            f"none fits the policy's turn budget env.max_turns = {env.max_turns}"
            if n_played == 0
            else f"{n_played} fit env.max_turns, none engine.max_len = {engine.max_len} tokens"
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
    model = build_model(model_cfg, tok)
    trainer = Midtrainer(
        model, mid, code=code, transcripts=transcripts, pad_id=tok.special("<|pad|>"), seed=seed
    )
    with MetricsLog(run_dir / "midtrain_metrics.jsonl") as metrics:
        info = trainer.run(metrics, progress=progress, deadline=deadline)
    pad = tok.special("<|pad|>")
    held = [(w.tolist(), [1] * len(w)) for w in held_code]
    info["held_out_code_loss"] = eval_loss(model, held, pad) if held else float("nan")
    info["data_seconds"] = prep_s
    info["transcripts"] = len(transcripts)
    info["params"] = sum(p.numel() for p in model.parameters())
    save_policy(model, run_dir / "midtrained", stage="midtrain", **{"steps": info["steps"]})
    log.info(
        "midtrain.done", **{k: round(v, 4) if isinstance(v, float) else v for k, v in info.items()}
    )
    return model, info


def evaluate_policy(
    model: MoETransformer,
    *,
    tasks: TaskConfig,
    env: EnvSettings,
    engine: EngineConfig,
    n_tasks: int,
    samples: int,
    seed: int,
    ks: tuple[int, ...] = (1,),
) -> EvalResult:
    """pass@k of ``model`` on ``n_tasks`` held-out tasks (``tasks.eval_seed``)."""
    chat = ChatFormat()
    held_out = TaskSource(tasks, tasks.eval_seed).take(0, n_tasks)
    eng = InferenceEngine(clone_model(model), engine, stop_id=chat.end_id)

    async def go() -> EvalResult:
        server = EngineServer(eng)
        serve = asyncio.create_task(server.serve())
        try:
            result, _ = await evaluate(
                server,
                chat,
                held_out,
                env_config(env),
                samples_per_task=samples,
                max_new_tokens=engine.max_new_tokens,
                max_observation_chars=env.max_observation_chars,
                seed=seed,
                ks=ks,
            )
        finally:
            server.close()
            await asyncio.gather(serve, return_exceptions=True)
        return result

    t0 = time.perf_counter()
    with batch_invariant(engine.deterministic):
        result = asyncio.run(go())
    log.info(
        "eval.done",
        tasks=result.tasks,
        samples=result.samples_per_task,
        pass_at={str(k): round(v, 4) for k, v in result.pass_at.items()},
        format_error_rate=round(result.format_error_rate, 3),
        seconds=round(time.perf_counter() - t0, 1),
    )
    return result


def reinforce(
    model: MoETransformer,
    *,
    tasks: TaskConfig,
    env: EnvSettings,
    engine: EngineConfig,
    trainer: TrainerConfig,
    rl: RLConfig,
    run_dir: Path,
    seed: int,
    task_offset: int = 0,
    progress: bool = False,
    max_wall_s: float | None = None,
    hooks: RunHooks | None = None,
    name: str | None = None,
) -> RunSummary:
    """The RL stage on training tasks ``task_offset..`` of ``tasks.train_seed``."""
    run = RLRun(
        model,
        rl=rl,
        trainer=trainer,
        engine=engine,
        env=env,
        tasks=TaskSource(tasks, tasks.train_seed, offset=task_offset),
        run_dir=run_dir,
        seed=seed,
        hooks=hooks,
        progress=progress,
        max_wall_s=max_wall_s,
        name=name,
    )
    return run.run()
