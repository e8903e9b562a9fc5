"""How far the trainer's numbers are from the engine's: log-prob mismatch and routing agreement.

On samples whose every token came from the trainer's current version, the trainer's
log-probs should be the engine's bit for bit (max |Δ|, k3, fraction of differing tokens);
on every sample, the k3 gap is what importance correction works against. Routing agreement
compares the trainer's *own* expert choices (a pass without replay) with the ones the engine
recorded, per decision and per token across all layers: what router replay saves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tandem.grpo import RolloutBatch
from tandem.moe_determinism import MoETransformer, compare_logprobs, routing_agreement
from tandem.orchestrator.training.scoring import ScoredPass, routes_known, score


def mismatch(
    batch: RolloutBatch, same: torch.Tensor, captured: Sequence[ScoredPass]
) -> dict[str, Any]:
    """Trainer (gradient pass, ``captured``) vs engine log-probs on the samples the update
    scored; ``same``: the rows whose every token came from the trainer's version."""
    out: dict[str, Any] = {"same_version_samples": int(same.sum())}
    trainer_lp, seen = _trainer_logprobs(batch, captured)
    if bool(seen.any()):
        sel = same & seen
        if bool(sel.any()):
            cmp = compare_logprobs(
                trainer_lp[sel], batch.rollout_logprobs[sel], batch.loss_mask[sel]
            )
            out.update(
                mismatch_tokens=cmp.tokens,
                mismatch_max_abs=cmp.max_abs_diff,
                mismatch_k3=cmp.kl_k3,
                mismatch_frac_differ=cmp.frac_tokens_differ,
            )
        cmp_all = compare_logprobs(
            trainer_lp[seen], batch.rollout_logprobs[seen], batch.loss_mask[seen]
        )
        out["offpolicy_k3_all"] = cmp_all.kl_k3
    return out


def _trainer_logprobs(
    batch: RolloutBatch, captured: Sequence[ScoredPass]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradient pass's log-probs [B, T] in batch order, and which rows it scored."""
    trainer_lp = torch.zeros_like(batch.rollout_logprobs)
    seen = torch.zeros(batch.num_sequences, dtype=torch.bool)
    rows = [int(r) for p in captured for r in p.rows.tolist()]
    if rows:
        trainer_lp[torch.tensor(rows)] = torch.cat([p.logprobs for p in captured])
        seen[torch.tensor(rows)] = True
    return trainer_lp, seen


def kl_to_start(
    batch: RolloutBatch,
    rows: torch.Tensor,
    start_logprobs: torch.Tensor,
    captured: Sequence[ScoredPass],
) -> dict[str, Any]:
    """How far the policy has moved from the one the run started from: k1 and k3 estimates
    of KL(policy || start) on the loss tokens of ``rows``, from the gradient pass's log-probs
    (the weights before this step's update) and the start policy's ``start_logprobs``
    [len(rows), T] of the same tokens. The tokens were sampled by the rollout's version, at
    most ``max_staleness`` behind, so the estimates are close to, not exactly, on-policy."""
    trainer_lp, seen = _trainer_logprobs(batch, captured)
    keep = seen[rows]
    if not bool(keep.any()):
        return {}
    rows = rows[keep]
    cmp = compare_logprobs(trainer_lp[rows], start_logprobs[keep], batch.loss_mask[rows])
    return {
        "kl_to_start_k1": cmp.kl_k1,
        "kl_to_start_k3": cmp.kl_k3,
        "kl_to_start_tokens": cmp.tokens,
    }


def routing_check(
    model: MoETransformer,
    batch: RolloutBatch,
    same: torch.Tensor,
    n_check: int,
    temperature: float,
    vocab: int | None = None,
) -> dict[str, Any]:
    """``n_check`` rows (same-version first) re-scored with and without replay, no gradient:
    how often the trainer routing freely picks the engine's experts."""
    out: dict[str, Any] = {}
    # a dense model has no routes; samples without the engine's have nothing to compare
    if n_check > 0 and model.config.moe_layers and routes_known(batch):
        order = torch.argsort((~same).to(torch.int8), stable=True)[:n_check]
        sub = batch.select(order)
        with torch.no_grad():
            lp_free, ids_free, counts = score(model, sub, "none", temperature, vocab)
            _, ids_replay, _ = score(model, sub, "R3", temperature, vocab)
        recorded = torch.cat([sub.extras["routes"][i, :n].long() for i, n in enumerate(counts)])
        free = routing_agreement(ids_free, recorded)
        replayed = routing_agreement(ids_replay, recorded)
        out.update(
            routing_agreement_free=free.per_decision,
            routing_agreement_free_tokens=free.per_token,
            routing_agreement_replay=replayed.per_decision,
        )
        sub_same = same[order]
        if bool(sub_same.any()):
            cmp = compare_logprobs(
                lp_free[sub_same], sub.rollout_logprobs[sub_same], sub.loss_mask[sub_same]
            )
            out["mismatch_max_abs_free"] = cmp.max_abs_diff
            sel_counts = [c for c, s in zip(counts, sub_same.tolist(), strict=True) if s]
            starts = np.cumsum([0, *counts])
            same_ids = torch.cat(
                [
                    ids_free[starts[i] : starts[i] + counts[i]]
                    for i, s in enumerate(sub_same.tolist())
                    if s
                ]
            )
            same_rec = torch.cat(
                [sub.extras["routes"][i, :n].long() for i, n in enumerate(counts) if sub_same[i]]
            )
            if sum(sel_counts):
                out["routing_agreement_same_version"] = routing_agreement(
                    same_ids, same_rec
                ).per_decision
    return out
