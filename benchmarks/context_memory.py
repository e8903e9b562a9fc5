"""Peak memory of the trainer's scoring pass against context length: the axis of
`stage_memory.py --context`.

One sequence of L tokens (1k to 16k) through a small dense Qwen3 with a real vocabulary
(SmolLM2's 49,152 ids, Qwen3's 151,936): the forward, log-probs and entropy of every
position, and the backward, under `batch_invariant()` as RL scores. Two settings:

- before: the whole sequence's logits at once (``trainer.logits_chunk = 0``), every layer's
  activations kept;
- after: logits formed 1,024 tokens at a time inside the pass, each chunk recomputed in
  backward (``trainer.logits_chunk = 1024``), and activation checkpointing
  (``trainer.activation_checkpointing``).

Each point runs in a fresh process capped at ``--limit-gib`` of address space, so a setting
that would take the machine's memory fails alone and is reported as over the cap. The figure
is the process's peak RSS less its RSS before the pass, and per token of context.

    uv run python benchmarks/stage_memory.py --context [--lengths 1024 4096 8192 16384]
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

GIB = 1 << 30
LENGTHS = (1024, 4096, 8192, 16384)
VOCABS = (49_152, 151_936)
SETTINGS = {"before": (0, False), "after": (1024, True)}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(length: int, vocab: int, setting: str, limit_gib: float) -> None:
    """One point, in this process; prints one JSON line."""
    cap = int(limit_gib * GIB)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    import torch

    from tandem.moe_determinism import (
        MoEConfig,
        MoETransformer,
        batch_invariant,
        target_logprobs_entropy,
    )

    chunk, checkpointing = SETTINGS[setting]
    config = MoEConfig(
        model_type="qwen3",
        vocab_size=vocab,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=768,
        num_experts=0,
        num_experts_per_tok=0,
        max_position_embeddings=length + 1,
    )
    model = MoETransformer(config)
    model.activation_checkpointing = checkpointing
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (length,), generator=gen)
    targets = torch.randint(0, vocab, (length,), generator=gen)
    base, t0 = _rss(), time.perf_counter()
    try:
        with batch_invariant():
            if chunk:

                def score(where: slice, logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
                    return target_logprobs_entropy(logits, targets[where])

                out = model(ids, cu_seqlens=[0, length], score=score, score_rows=chunk)
                assert out.scores is not None
                logprobs = out.scores[0]
            else:
                logits = model(ids, cu_seqlens=[0, length]).logits
                logprobs, _ = target_logprobs_entropy(logits, targets)
            logprobs.sum().backward()
    except (RuntimeError, MemoryError) as e:  # the address-space cap
        print(json.dumps({"over": True, "why": str(e).splitlines()[0][:120]}))
        return
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"extra": peak - base, "seconds": time.perf_counter() - t0}))


def run(lengths: list[int], vocabs: list[int], limit_gib: float) -> None:
    """Every point in a fresh process; prints a table."""
    print(
        f"trainer scoring pass, one sequence, dense Qwen3 (4 layers, hidden 256), "
        f"batch-invariant; each point capped at {limit_gib:g} GiB\n"
    )
    print(f"{'vocab':>8} {'tokens':>7} {'setting':>7} {'peak GiB':>9} {'KiB/token':>10} {'s':>6}")
    for vocab in vocabs:
        for length in lengths:
            for setting in SETTINGS:
                cmd = [sys.executable, __file__, "--child", str(length), str(vocab), setting]
                proc = subprocess.run(
                    [*cmd, str(limit_gib)], capture_output=True, text=True, cwd=Path.cwd()
                )
                lines = proc.stdout.strip().splitlines()
                got = json.loads(lines[-1]) if lines else {"over": True, "why": proc.stderr[-200:]}
                if got.get("over"):
                    row = f"{'over cap':>9} {'':>10} {'':>6}"
                else:
                    per_token = got["extra"] / length / 1024
                    row = f"{got['extra'] / GIB:9.2f} {per_token:10.0f} {got['seconds']:6.1f}"
                print(f"{vocab:>8} {length:>7} {setting:>7} {row}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        child(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], float(sys.argv[5]))
    else:
        run(list(LENGTHS), list(VOCABS), 14.0)
