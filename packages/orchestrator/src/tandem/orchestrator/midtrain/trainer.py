"""Mid-training: next-token prediction on real code and on oracle agent transcripts.

Each batch mixes packed windows of standard-library source (general code) with whole oracle
transcripts (the chat and tool-call format, reading a file, copying a line into an edit,
the fix itself). The loss is the mean next-token cross-entropy over the scored positions of
the batch: every token of a code window, and every token (or only the assistant turns) of a
transcript. The stage ends by saving the model in the Hugging Face layout.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import structlog
import torch
import torch.nn.functional as F

from tandem.moe_determinism import MoETransformer
from tandem.orchestrator.artifacts.metrics import MetricsLog
from tandem.orchestrator.config import MidtrainConfig

log = structlog.get_logger()

Sequence_ = tuple[list[int], list[int]]  # (ids, mask of scored positions)


def lr_at(step: int, config: MidtrainConfig) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio * lr``."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    span = max(config.steps - config.warmup_steps, 1)
    progress = min((step - config.warmup_steps) / span, 1.0)
    floor = config.min_lr_ratio
    return config.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_batch(items: Sequence[Sequence_], pad_id: int) -> tuple[torch.Tensor, ...]:
    """Padded (ids [B, T], lengths [B], target mask [B, T-1]) of sequences."""
    t = max(len(ids) for ids, _ in items)
    ids = torch.full((len(items), t), pad_id, dtype=torch.long)
    mask = torch.zeros(len(items), t, dtype=torch.bool)
    for i, (seq, m) in enumerate(items):
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.bool)
    lengths = torch.tensor([len(s) for s, _ in items])
    return ids, lengths, mask[:, 1:]


def batch_loss(
    model: MoETransformer,
    ids: torch.Tensor,
    lengths: torch.Tensor,
    target_mask: torch.Tensor,
    logits_chunk: int = 0,
) -> torch.Tensor:
    """Mean cross-entropy of the next token over the scored target positions; with
    ``logits_chunk``, from the logits of that many tokens at a time (`MoETransformer`'s
    ``score``), never the whole batch's."""
    fed = (lengths - 1).clamp_min(0)
    valid = target_mask & (torch.arange(ids.shape[1] - 1)[None, :] < fed[:, None])
    if logits_chunk:
        keep = torch.arange(ids.shape[1] - 1)[None, :] < fed[:, None]
        targets = ids[:, 1:][keep]  # the fed tokens' next tokens, in the model's flat order

        def score(where: slice, logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return (F.cross_entropy(logits.float(), targets[where], reduction="none"),)

        out = model(ids[:, :-1], fed, score=score, score_rows=logits_chunk)
        assert out.scores is not None
        ce = out.scores[0]
        return (ce * valid[keep]).sum() / valid.sum().clamp_min(1)
    out = model(ids[:, :-1], fed)
    logits = out.logits.float()
    ce = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
    ).view_as(target_mask)
    return (ce * valid).sum() / valid.sum().clamp_min(1)


class Midtrainer:
    """Runs the mid-training steps on a fixed mix of code windows and transcripts."""

    def __init__(
        self,
        model: MoETransformer,
        config: MidtrainConfig,
        *,
        code: Sequence[np.ndarray],
        transcripts: Sequence[Sequence_],
        pad_id: int,
        seed: int,
    ) -> None:
        if not transcripts and config.transcript_fraction > 0:
            raise ValueError("transcript_fraction > 0 but there are no transcripts")
        if not code and config.transcript_fraction < 1:
            raise ValueError("transcript_fraction < 1 but there is no code")
        self.model = model
        self.config = config
        model.activation_checkpointing = config.activation_checkpointing
        self.code = [(w.tolist(), [1] * len(w)) for w in code]
        self.transcripts = list(transcripts)
        self.pad_id = pad_id
        self.rng = random.Random(seed)
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay
        )

    def _batch(self) -> list[Sequence_]:
        c = self.config
        n_tr = round(c.batch_size * c.transcript_fraction)
        items = [self.rng.choice(self.transcripts) for _ in range(n_tr)]
        items += [self.rng.choice(self.code) for _ in range(c.batch_size - n_tr)]
        return items

    def run(
        self, metrics: MetricsLog | None = None, progress: Any = None, deadline: float | None = None
    ) -> dict[str, float]:
        c = self.config
        self.model.train()
        t0 = time.perf_counter()
        tokens = 0
        ema = None
        done = 0
        for step in range(c.steps):
            if deadline is not None and time.perf_counter() > deadline:
                log.info("midtrain.time_budget_reached", step=step)
                break
            for group in self.optimizer.param_groups:
                group["lr"] = lr_at(step, c)
            ids, lengths, mask = make_batch(self._batch(), self.pad_id)
            loss = batch_loss(self.model, ids, lengths, mask, self.config.logits_chunk)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0))
            self.optimizer.step()
            tokens += int(lengths.sum())
            done = step + 1
            value = float(loss.detach())
            ema = value if ema is None else 0.9 * ema + 0.1 * value
            if metrics is not None:
                metrics.log(step, {"loss": value, "lr": lr_at(step, c), "grad_norm": grad_norm})
            if progress is not None:
                progress(step, value)
            if step % c.log_every == 0 or step == c.steps - 1:
                elapsed = time.perf_counter() - t0
                log.info(
                    "midtrain.step",
                    step=step,
                    loss=round(value, 4),
                    loss_ema=round(ema, 4),
                    lr=round(lr_at(step, c), 6),
                    tokens_per_s=round(tokens / max(elapsed, 1e-9)),
                )
        self.model.eval()
        return {
            "steps": done,
            "loss_ema": ema or float("nan"),
            "seconds": time.perf_counter() - t0,
            "tokens": tokens,
        }


@torch.no_grad()
def eval_loss(
    model: MoETransformer, items: Sequence[Sequence_], pad_id: int, batch: int = 8
) -> float:
    """Mean next-token loss over ``items`` (held-out code or transcripts)."""
    total, n = 0.0, 0
    for i in range(0, len(items), batch):
        chunk = items[i : i + batch]
        ids, lengths, mask = make_batch(chunk, pad_id)
        total += float(batch_loss(model, ids, lengths, mask)) * len(chunk)
        n += len(chunk)
    return total / max(n, 1)
