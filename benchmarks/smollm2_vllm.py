"""The vLLM side of `smollm2.py`: a CPU server tandem starts, turns played on it with
`VllmEngine`, and the peak RSS of the server's process tree sampled while it serves."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

VOCAB = 49152
Figures = dict[str, Any]


def tree_rss(pid: int) -> int:
    """The summed RSS of ``pid`` and its descendants (without psutil: of its session, which
    the server starts, from /proc)."""
    total = 0
    try:
        import psutil
    except ImportError:
        page = os.sysconf("SC_PAGE_SIZE")
        for d in Path("/proc").iterdir():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
                if int(stat[3]) == pid:
                    total += int((d / "statm").read_text().split()[1]) * page
        return total
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                total += p.memory_info().rss
    return total


def sample_peak(pid: int, peak: list[int], stop: threading.Event) -> threading.Thread:
    """A thread keeping ``peak[0]`` at the highest `tree_rss` seen, every 0.2 s until ``stop``."""

    def loop() -> None:
        while not stop.wait(0.2):
            peak[0] = max(peak[0], tree_rss(pid))

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


async def vllm_turns(engine: Any, prompts: list[list[int]], new_tokens: int, seed: int) -> Figures:
    import torch

    async def one(i: int, prompt: list[int]) -> int:
        slot = await engine.acquire()
        try:
            gen = torch.Generator().manual_seed(seed + i)
            return len((await engine.generate(slot, prompt, gen, new_tokens)).tokens)
        finally:
            engine.release(slot)

    t0 = time.perf_counter()
    made = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return {
        "wall_s": time.perf_counter() - t0,
        "tokens": sum(made),
        "short": sum(m < new_tokens for m in made),
    }


def vllm_side(
    model_dir: Path,
    sets: dict[str, list[list[int]]],
    concurrency: tuple[int, ...],
    new_tokens: int,
    work: Path,
    progress: Callable[[str], None],
    update: tuple[Path, dict[str, Any]] | None = None,
) -> Figures:
    """Start a CPU server on ``model_dir`` and play ``sets`` (``warmup`` and ``run{c}`` for
    each concurrency c) as `smollm2.py` describes; its figures. ``update``: a store holding
    versions 0 and 1 of the model and its `hf_layout`; the server then follows the store
    from version 0 and applies version 1 (`weight_update.py`)."""
    from tandem.orchestrator.config import EngineConfig
    from tandem.orchestrator.inference.engine_config import VllmConfig
    from tandem.orchestrator.inference.vllm.engine import VllmEngine
    from tandem.orchestrator.inference.vllm.environment import vllm_python
    from tandem.orchestrator.inference.vllm.server import VllmServer

    longest = max(len(p) for s in sets.values() for p in s)
    vllm = VllmConfig(kv_cache_gib=2.0, extra_args=["--generation-config", "vllm"])
    config = EngineConfig(kind="vllm", max_slots=max(concurrency),
                          max_len=longest + new_tokens + 1, vllm=vllm)  # fmt: skip
    python = vllm_python()
    progress("vLLM: starting its CPU server")
    t0 = time.perf_counter()
    server = VllmServer.start(python, model_dir, config, log_path=work / "vllm.log")
    out: Figures = {"start_s": time.perf_counter() - t0}
    out["idle_rss"] = tree_rss(server.process.pid)
    peak, stop = [out["idle_rss"]], threading.Event()
    sampler = sample_peak(server.process.pid, peak, stop)

    async def fresh(engine: VllmEngine, prompts: list[list[int]], n: int, c: int) -> Figures:
        """``prompts`` from a cache holding the warm-up turn's (the common system message)."""
        r = await engine.http().post(server.url + "/reset_prefix_cache")
        r.raise_for_status()
        await vllm_turns(engine, sets["warmup"], 1, seed=0)
        return await vllm_turns(engine, prompts, n, seed=c)

    async def go() -> None:
        engine = VllmEngine([server.url], config, stop_id=-1, vocab=VOCAB, model_vocab=VOCAB,
                            route_shape=(0, 0))  # fmt: skip
        await vllm_turns(engine, sets["warmup"], 4, seed=0)
        for c in concurrency:
            progress(f"vLLM: {c} sequence(s), 1 token, then {new_tokens} tokens")
            first = await fresh(engine, sets[f"run{c}"], 1, c)
            run = await fresh(engine, sets[f"run{c}"], new_tokens, c)
            decode_s = run["wall_s"] - first["wall_s"]
            tps = (run["tokens"] - c) / decode_s if decode_s > 0 else float("nan")
            out[str(c)] = {**run, "prefill_s": first["wall_s"], "decode_tps": tps}
            progress(f"  {json.dumps(out[str(c)])}")
        await engine.close()
        if update is not None:
            from tandem.orchestrator.inference.vllm.weights import VllmWeights

            weights = VllmWeights(server.url)
            try:
                await weights.follow(str(update[0]), 0, update[1])
                done = await weights.update(1)
            finally:
                await weights.close()
            if done is None:
                raise RuntimeError("the vLLM server did not apply version 1")
            out["update"] = {"prepare_s": done.prepare_s, "pause_s": done.pause_s}
            progress(f"  weight update: {json.dumps(out['update'])}")

    try:
        asyncio.run(go())
    finally:
        stop.set()
        sampler.join()
        out["peak_rss"] = peak[0]
        server.close()
    return out
