"""`GRPOStep`: one optimizer step per batch of scored rollouts, through accelerate.

It neither generates nor loops over a dataset (TRL's ``GRPOTrainer`` does both): the caller
brings the rollouts and calls `GRPOStep.step` once per batch. accelerate, the ``trainer``
extra (``pip install "tandem-grpo[trainer]"``), is imported only when a `GRPOStep` is built;
the losses it combines need torch alone. ``GRPOTrainer`` is a deprecated alias of `GRPOStep`
for one release.

A step: rewards (optionally KL-penalised) -> group advantages -> drop all-equal groups (DAPO
dynamic sampling) -> global loss normaliser (one all-reduce) -> micro-batches: forward hook,
importance weights, `policy_loss`, backward (gradients synchronised only on the last one)
-> gradient clipping -> optimizer step -> metrics (two collectives).

Why the update does not depend on the split: every micro-batch loss is a partial sum over the
*global* normaliser, so the gradients accumulated over micro-batches and summed over processes
are the gradient of the global-batch loss. DDP averages gradients over processes, so each
process scales its loss by the number of processes.

Under FSDP (``fsdp=True``: parameters sharded along dim 0, e.g. by torch's `fully_shard`)
the gradients are reduce-scattered instead: only after the last micro-batch (as DDP's
all-reduce), every rank runs the same number of micro-batches (the shorter ones pad with
zero-weight passes, since every forward gathers parameters collectively), and the clipping
norm is the shard layout's (`sharded_grad_norm`), which one process reproduces with
``step(shards=N)``.
"""

from __future__ import annotations

import functools
import math
import warnings
from contextlib import nullcontext
from typing import Any

import structlog
import torch

from tandem.grpo.advantages import batch_advantages, trained_groups
from tandem.grpo.aggregation import LossNormalizer
from tandem.grpo.batch import (
    ForwardFn,
    ForwardOutput,
    RolloutBatch,
    causal_lm_forward,
    group_owners,
)
from tandem.grpo.config import GRPOConfig
from tandem.grpo.data_parallel import add_grads, fsdp_no_sync
from tandem.grpo.errors import GRPOError
from tandem.grpo.importance import importance_weights
from tandem.grpo.kl import kl_estimate
from tandem.grpo.loss import policy_loss
from tandem.grpo.metrics import LOSS_TOKEN_MEANS, MAXED, SUMMED, MetricSums, step_metrics
from tandem.grpo.numerics import as_float
from tandem.grpo.segments import RowTerms, step_episodes
from tandem.grpo.sharded_norm import clip_sharded_grads

log = structlog.get_logger()


class GRPOStep:
    """One GRPO-family optimizer step on ``model`` per call of `step`, on rollouts given to it.

    Needs accelerate (``pip install "tandem-grpo[trainer]"``); raises `GRPOError` saying so
    when it is missing.

    Args:
        model, optimizer: prepared here with ``accelerator.prepare`` unless the optimizer is
            already an accelerate ``AcceleratedOptimizer`` (then both are used as given).
        config: loss, correction and step settings.
        accelerator: an ``accelerate.Accelerator`` (created with defaults when None). Its
            ``gradient_accumulation_steps`` must be 1: the trainer micro-batches itself.
        forward_fn: ``forward_fn(model, micro_batch) -> ForwardOutput | logprobs`` (see
            `ForwardFn`); defaults to `causal_lm_forward`.
        lr_scheduler: stepped once after every optimizer step.
        fsdp: the parameters are sharded along dim 0 over the processes (pass the model
            already sharded, with an ``AcceleratedOptimizer``); see the module doc.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        config: GRPOConfig,
        accelerator: Any = None,
        *,
        forward_fn: ForwardFn | None = None,
        lr_scheduler: Any = None,
        fsdp: bool = False,
    ) -> None:
        try:
            from accelerate import Accelerator
            from accelerate.optimizer import AcceleratedOptimizer
        except ModuleNotFoundError as e:
            if (e.name or "accelerate").partition(".")[0] != "accelerate":
                raise
            raise GRPOError(
                'GRPOStep needs accelerate, the "trainer" extra: '
                'pip install "tandem-grpo[trainer]" (the losses need torch alone)'
            ) from None

        self.accelerator = accelerator if accelerator is not None else Accelerator()
        if self.accelerator.gradient_accumulation_steps != 1:
            raise GRPOError(
                "GRPOStep splits batches into micro-batches itself; create the Accelerator "
                "with gradient_accumulation_steps=1 and set GRPOConfig.micro_batch_size instead"
            )
        if isinstance(optimizer, AcceleratedOptimizer):
            self.model, self.optimizer = model, optimizer
        else:
            self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        self.config = config
        self.forward_fn: ForwardFn = forward_fn or functools.partial(
            causal_lm_forward, entropy_grad=config.entropy_coef > 0
        )
        self.lr_scheduler = lr_scheduler
        self.fsdp = fsdp

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def _sum(self, t: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(t, reduction="sum") if self._distributed else t

    def _max(self, t: torch.Tensor) -> torch.Tensor:
        if not self._distributed:
            return t
        return self.accelerator.gather(t[None]).amax(0)

    @property
    def _distributed(self) -> bool:
        return self.accelerator.num_processes > 1

    def _forward(self, micro: RolloutBatch) -> ForwardOutput:
        with self.accelerator.autocast():
            out = self.forward_fn(self.model, micro)
        if isinstance(out, torch.Tensor):
            out = ForwardOutput(out)
        elif not isinstance(out, ForwardOutput):
            out = ForwardOutput(*out)
        if out.logprobs.shape != micro.input_ids.shape:
            raise GRPOError(
                f"forward_fn returned log-probs of shape {tuple(out.logprobs.shape)} for "
                f"input_ids of shape {tuple(micro.input_ids.shape)}; return one log-prob per "
                "token, aligned with input_ids (position 0 unused)"
            )
        if not out.logprobs.requires_grad:
            raise GRPOError(
                "forward_fn returned log-probs without gradient; do not detach "
                "them or run the model under torch.no_grad()"
            )
        forward_kl = self.config.kl_estimator == "forward" and self.config.kl_coef > 0
        if forward_kl and (out.kl is None or not out.kl.requires_grad):
            raise GRPOError(
                "kl_estimator='forward' needs forward_fn to return the per-token KL to the "
                "reference with gradient (ForwardOutput.kl)"
            )
        if self.config.entropy_coef > 0 and (out.entropy is None or not out.entropy.requires_grad):
            raise GRPOError("entropy_coef > 0 needs forward_fn to return entropy with gradient")
        return out

    def step(
        self, batch: RolloutBatch, *, version: int | None = None, shards: int = 1
    ) -> dict[str, float]:
        """One optimizer step on this process's share of the batch; returns global metrics.

        Each process passes its own rows (whole groups; see `shard_by_group`). Metrics are
        reduced over processes, so every process returns the same dict.

        ``version``: the policy version of the weights the step starts from. The caller
        counts versions (an applied step, ``metrics["step_applied"]``, makes the next one);
        the trainer only measures each trajectory's staleness against it (default: the
        newest version in the batch).

        ``shards`` (one process only): accumulate the gradient as that many data-parallel
        processes would, each summing the micro-batches of its `shard_by_group` share, the
        shares then added in rank order. For 2 this gives the bits of a 2-process run (DDP's
        all-reduce of two addends is that one addition; the loss scale and the average are
        powers of two); for more, the collective's own summation order decides.
        """
        if shards > 1 and self._distributed:
            raise GRPOError("shards emulates several processes in one; this run has them")
        cfg, acc = self.config, self.accelerator
        batch.validate()
        if batch.num_sequences == 0:
            raise GRPOError("empty batch: every process needs at least one trajectory")
        batch = batch.to(self.device)
        adv = batch_advantages(batch, self.config)
        keep = trained_groups(batch.rewards, batch.group_ids, cfg, batch.episode_ids)
        mask = batch.loss_mask
        kept_mask = mask & keep[:, None]
        # sequences are episodes: rows sharing an episode id (segments) count once
        ep = step_episodes(kept_mask, keep, batch.rewards, batch.episode_ids)

        counts = torch.stack(
            [
                kept_mask.sum(),
                ep.with_tokens,
                ep.kept,
                torch.unique(batch.group_ids).numel() * torch.ones((), device=self.device),
                torch.unique(batch.group_ids[keep]).numel() * torch.ones((), device=self.device),
                torch.tensor(batch.num_sequences, device=self.device),
                ep.total,
            ]
        ).double()
        tokens, seqs, total_seqs, groups, groups_kept, all_seqs, episodes = self._sum(
            counts
        ).tolist()
        normalizer = LossNormalizer(tokens=tokens, sequences=seqs, total_sequences=total_seqs)
        rows = RowTerms(adv, ep.seq_tokens, ep.counted)

        sums = MetricSums(self.device)
        sums.add("reward_sum", ep.rewards.double().sum())
        if version is None:
            version = int(self._max(batch.policy_version.max().double()))
        staleness = (version - batch.policy_version).double()
        sums.add("staleness_sum", staleness.sum())
        sums.max("staleness_max", staleness.max())

        self.model.train()
        if total_seqs == 0:
            log.warning(
                "grpo_step_skipped",
                reason="every group has equal rewards",
                groups=int(groups),
                policy_version=version,
            )
            return self._finish(sums, normalizer, groups, groups_kept, all_seqs, episodes, None)

        if shards > 1:
            applied = self._step_as_shards(batch, rows, keep, normalizer, sums, shards)
            return self._finish(sums, normalizer, groups, groups_kept, all_seqs, episodes, applied)
        kept_rows = keep.nonzero().flatten()
        zero_weight = kept_rows.numel() == 0
        if zero_weight:  # this process still joins the gradient all-reduce, with zero loss
            kept_rows = torch.zeros(1, dtype=torch.long, device=self.device)
        chunks = list(kept_rows.split(cfg.micro_batch_size))
        scales = [0.0 if zero_weight else float(acc.num_processes)] * len(chunks)
        if self.fsdp and self._distributed:  # as many (collective) passes as the busiest rank
            most = int(self._max(torch.tensor(float(len(chunks)), device=self.device)))
            scales += [0.0] * (most - len(chunks))
            chunks += [kept_rows[:1]] * (most - len(chunks))
        for i, (chunk, scale) in enumerate(zip(chunks, scales, strict=True)):
            with self._no_sync(last=i == len(chunks) - 1):
                self._micro_step(batch.select(chunk), rows.select(chunk), normalizer, scale, sums)
        applied = self._apply()
        return self._finish(sums, normalizer, groups, groups_kept, all_seqs, episodes, applied)

    def _no_sync(self, *, last: bool) -> Any:
        """Gradients are reduced over processes only on the last micro-batch."""
        if last:
            return nullcontext()
        if self.fsdp and hasattr(self.model, "set_requires_gradient_sync"):
            return fsdp_no_sync(self.model)
        return self.accelerator.no_sync(self.model)

    def _step_as_shards(
        self,
        batch: RolloutBatch,
        rows: RowTerms,
        keep: torch.Tensor,
        normalizer: LossNormalizer,
        sums: MetricSums,
        shards: int,
    ) -> tuple[float, bool]:
        """`step`'s gradient as ``shards`` processes would sum it (see `step`)."""
        owners = group_owners(batch, shards).to(keep.device)
        params = list(self.model.parameters())
        total: list[torch.Tensor | None] = [None] * len(params)
        for rank in range(shards):
            mine = ((owners == rank) & keep).nonzero().flatten()
            if mine.numel() == 0:
                continue  # that process would add zeros
            self.optimizer.zero_grad(set_to_none=True)
            for chunk in mine.split(self.config.micro_batch_size):
                self._micro_step(batch.select(chunk), rows.select(chunk), normalizer, 1.0, sums)
            for i, p in enumerate(params):
                total[i] = add_grads(total[i], p.grad)
        for p, g in zip(params, total, strict=True):
            p.grad = g
        return self._apply(shards)

    def _micro_step(
        self,
        micro: RolloutBatch,
        rows: RowTerms,
        normalizer: LossNormalizer,
        scale: float,
        sums: MetricSums,
    ) -> None:
        cfg = self.config
        adv = rows.adv
        out = self._forward(micro)
        mask = micro.loss_mask
        old = micro.old_logprobs if micro.old_logprobs is not None else out.logprobs.detach()
        weights, is_metrics = importance_weights(
            as_float(old),
            as_float(micro.rollout_logprobs),
            mask,
            cfg.is_mode,
            cfg.is_cap,
            cfg.is_lower,
            cfg.log_ratio_clamp,
        )
        loss, metrics = policy_loss(
            out.logprobs,
            old,
            adv,
            mask,
            config=cfg,
            ref_logprobs=micro.ref_logprobs,
            is_weights=weights,
            entropy=out.entropy,
            normalizer=normalizer,
            kl=out.kl,
            seq_tokens=rows.seq_tokens,
        )
        self.accelerator.backward(loss * scale)
        if scale == 0.0:
            return
        with torch.no_grad():
            n = metrics["tokens"]
            sums.add("loss", metrics["loss"])
            sums.add("pg_loss", metrics["pg_loss"])
            sums.add("tokens", n)
            for name in LOSS_TOKEN_MEANS:
                if name in metrics:
                    sums.add(name, metrics[name] * n)
            sums.add("is_weight_mean", is_metrics["is_weight_mean"] * n)
            sums.add("is_clipped_frac", is_metrics["is_clipped_frac"] * n)
            sums.add("is_w_sq", torch.where(mask, weights.square(), 0.0).sum())
            sums.max("ratio_max", metrics["ratio_max"])
            sums.max("is_weight_max", is_metrics["is_weight_max"])
            mismatch = kl_estimate(
                as_float(micro.rollout_logprobs), as_float(old), mask, "k3", cfg.log_ratio_clamp
            )
            sums.add("mismatch_k3", torch.where(mask, mismatch, 0.0).sum())
            sums.add("nonfinite_logprob_frac", (mask & ~torch.isfinite(out.logprobs)).sum())
            counted = adv if rows.counted is None else adv[rows.counted]  # once per episode
            sums.add("adv_abs_sum", counted.abs().sum())

    def _apply(self, shards: int = 1) -> tuple[float, bool]:
        """Clip, step and zero the gradients; returns (grad norm, whether the step was applied).

        ``shards``: processes emulated by `step(shards=...)`; under ``fsdp`` the norm is
        computed in their shard layout."""
        max_norm = self.config.max_grad_norm or math.inf
        if self.fsdp:
            grad_norm = clip_sharded_grads(self.model.parameters(), max_norm, shards)
        else:
            grad_norm = float(self.accelerator.clip_grad_norm_(self.model.parameters(), max_norm))
        applied = math.isfinite(grad_norm)
        if applied:
            self.optimizer.step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        else:
            log.warning(
                "grpo_step_skipped",
                reason="non-finite gradient norm from the model",
                grad_norm=grad_norm,
            )
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, applied

    def _finish(
        self,
        sums: MetricSums,
        normalizer: LossNormalizer,
        groups: float,
        groups_kept: float,
        all_seqs: float,
        episodes: float,
        applied: tuple[float, bool] | None,
    ) -> dict[str, float]:
        raw = sums.reduce(self._sum, self._max, SUMMED, list(MAXED))
        lr = float(self.optimizer.param_groups[0]["lr"])
        return step_metrics(raw, normalizer, groups, groups_kept, all_seqs, applied, lr, episodes)


def __getattr__(name: str) -> Any:
    if name == "GRPOTrainer":
        warnings.warn(_deprecated_alias_message(__name__), DeprecationWarning, stacklevel=2)
        return GRPOStep
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _deprecated_alias_message(module: str) -> str:
    """The warning given when ``GRPOTrainer`` (removed in the next release) is used."""
    return (
        f"{module}.GRPOTrainer is deprecated and will be removed in the next release: "
        f"use {module}.GRPOStep, the same class (renamed because TRL's GRPOTrainer generates "
        "and trains from a dataset, while this class takes one optimizer step on given rollouts)"
    )
