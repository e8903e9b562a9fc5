"""The RL trainer: GRPO on scored groups with router replay, and train/rollout agreement checks.

`tandem.grpo.GRPOTrainer` does the update (Dr. GRPO advantages, clipped policy loss,
truncated importance weights against the rollout log-probs). This module supplies the MoE
forward hook: the trainer re-scores each trajectory inside `batch_invariant()` with the
experts the engine recorded (R3), or with its own routes from a no-grad pass (R2), or free.

It also measures the train-vs-rollout mismatch: on samples whose every
token came from the trainer's current version, the trainer's log-probs against the
engine's (max |Δ|, k3, fraction of differing tokens), and routing agreement of the
trainer's *own* choice (a no-replay pass) with the engine's recorded experts.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from tandem.grpo import ForwardOutput, GRPOConfig, GRPOTrainer, RolloutBatch, shard_by_group
from tandem.moe_determinism import (
    MoETransformer,
    RouterReplay,
    RoutingTrace,
    batch_invariant,
    compare_logprobs,
    routing_agreement,
    token_logprobs,
)
from tandem.orchestrator.config import TrainerConfig
from tandem.orchestrator.engine import sampling_logits
from tandem.orchestrator.episode import Sample
from tandem.orchestrator.prefix_scoring import SharedLayout, score_shared
from tandem.orchestrator.sharding import shard_model


def collate(groups: Sequence[Sequence[Sample]]) -> RolloutBatch:
    """Right-padded batch of every sample of ``groups`` (one group id per group)."""
    samples = [s for g in groups for s in g]
    if not samples:
        raise ValueError("cannot collate an empty list of groups")
    b, t = len(samples), max(len(s.tokens) for s in samples)
    layers, top_k = samples[0].routes.shape[1:]
    ids = torch.zeros(b, t, dtype=torch.long)
    attn = torch.zeros(b, t, dtype=torch.bool)
    mask = torch.zeros(b, t, dtype=torch.bool)
    lps = torch.zeros(b, t, dtype=torch.float32)
    wide = max(int(s.routes.max(initial=0)) for s in samples) > 255
    route_dtype = torch.int32 if wide else torch.uint8
    routes = torch.zeros(b, max(t - 1, 1), layers, top_k, dtype=route_dtype)
    for i, s in enumerate(samples):
        n = len(s.tokens)
        ids[i, :n] = torch.tensor(s.tokens)
        attn[i, :n] = True
        mask[i, :n] = torch.tensor(s.loss_mask, dtype=torch.bool)
        lps[i, :n] = torch.tensor(s.logprobs, dtype=torch.float32)
        routes[i, : n - 1] = torch.from_numpy(s.routes.astype(np.int64)).to(route_dtype)
    group_ids = torch.tensor([gi for gi, g in enumerate(groups) for _ in g], dtype=torch.long)
    return RolloutBatch(
        input_ids=ids,
        loss_mask=mask,
        rollout_logprobs=lps,
        rewards=torch.tensor([s.reward for s in samples], dtype=torch.float32),
        group_ids=group_ids,
        policy_version=torch.tensor([s.min_version for s in samples], dtype=torch.long),
        attention_mask=attn,
        extras={
            "routes": routes,
            "row": torch.arange(b),
            "max_version": torch.tensor([s.max_version for s in samples], dtype=torch.long),
        },
    )


def _traces(routes: torch.Tensor, lengths: torch.Tensor, num_experts: int) -> list[RoutingTrace]:
    return [
        RoutingTrace.from_ids(routes[i, : int(n)].numpy(), num_experts)
        for i, n in enumerate(lengths.tolist())
    ]


def score(
    model: MoETransformer,
    batch: RolloutBatch,
    replay: str,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Log-probs [B, T] of ``batch`` (position 0 is 0) and the routes [N, layers, k] used.

    Only tokens 0..n-2 of a row are fed: the last token predicts nothing, and the engine
    never fed it either (so it has no recorded route). Log-probs are those of the sampling
    distribution at the engine's ``temperature`` (`sampling_logits`).
    """
    ids = batch.input_ids
    assert batch.attention_mask is not None
    fed = (batch.attention_mask.sum(1) - 1).clamp_min(0)
    inputs = ids[:, :-1] if ids.shape[1] > 1 else ids
    n_exp = getattr(model, "module", model).config.num_experts  # DDP wraps the model
    routing = None
    if replay == "R3":
        routing = RouterReplay(_traces(batch.extras["routes"], fed, n_exp), "R3")
    elif replay == "R2":
        with torch.no_grad():
            own = model(inputs, fed)
        routing = RouterReplay(own.traces(), "R2")
    out = model(inputs, fed, routing=routing)
    logits = sampling_logits(out.logits, temperature)
    lp = token_logprobs(logits, ids[:, 1:]) if ids.shape[1] > 1 else logits[..., 0]
    lp = F.pad(lp, (1, 0)) if ids.shape[1] > 1 else torch.zeros_like(ids, dtype=torch.float32)
    return lp, out.route_ids, out.counts


class _Pass(NamedTuple):
    """What the forward hook computed for one micro-batch: its rows, their detached
    log-probs, the tokens fed, and the prefix tokens sharing did not feed again."""

    rows: torch.Tensor
    logprobs: torch.Tensor
    tokens_fed: int
    tokens_shared: int


class _ReplayForward:
    """The GRPO forward hook; keeps what it computed for the mismatch check and the metrics."""

    def __init__(self, replay: str, temperature: float, share_prefixes: bool = True) -> None:
        self.replay = replay
        self.temperature = temperature
        self.share_prefixes = share_prefixes
        self.captured: list[_Pass] = []

    def logprobs(
        self, model: torch.nn.Module, micro: RolloutBatch
    ) -> tuple[torch.Tensor, int, int]:
        """Log-probs [B, T] of ``micro`` under ``model``, the tokens fed, the tokens shared."""
        if self.share_prefixes:
            layout = SharedLayout(micro, match_routes=self.replay == "R3")
            lp = score_shared(model, micro, self.replay, self.temperature, layout)  # type: ignore[arg-type]
            return lp, len(layout.tokens), layout.shared_tokens
        lp, _, counts = score(model, micro, self.replay, self.temperature)  # type: ignore[arg-type]
        return lp, sum(counts), 0

    def __call__(self, model: torch.nn.Module, micro: RolloutBatch) -> ForwardOutput:
        lp, fed, shared = self.logprobs(model, micro)
        self.captured.append(_Pass(micro.extras["row"], lp.detach(), fed, shared))
        return ForwardOutput(lp)


def frozen_copy(model: MoETransformer, state: dict[str, torch.Tensor] | None) -> MoETransformer:
    """A copy of ``model`` (with ``state`` loaded when given) that takes no gradient."""
    reference = copy.deepcopy(model)
    if state is not None:
        reference.load_state_dict(state)
    reference.requires_grad_(False)
    return reference.eval()


class RLTrainer:
    """GRPO updates of an MoE policy with replay, importance correction and agreement checks.

    With ``loss.kl_coef`` > 0 the trainer keeps a frozen reference policy: ``reference`` when
    given, else the weights ``model`` holds here (the run's starting policy; a resumed run
    builds its trainer before it loads the checkpoint). Each step scores the batch with it,
    under the same replay as the update, for GRPO's KL penalty, which keeps RL from drifting
    far from what mid-training taught. The reference costs one more no-grad forward per step
    and one more copy of the weights per rank.
    """

    def __init__(
        self,
        model: MoETransformer,
        config: TrainerConfig,
        *,
        policy_version: int = 0,
        deterministic: bool = True,
        temperature: float = 1.0,
        rank: int = 0,
        world: int = 1,
        reference: dict[str, torch.Tensor] | None = None,
    ) -> None:
        from accelerate import Accelerator, DistributedDataParallelKwargs

        self.config = config
        self.deterministic = deterministic
        self.model = model
        # copied before sharding: every rank scores its share of the batch with whole weights
        self.reference = frozen_copy(model, reference) if config.loss.kl_coef > 0 else None
        loss = config.loss
        self.grpo_config = GRPOConfig(
            clip_eps_low=loss.clip_eps_low,
            clip_eps_high=loss.clip_eps_high,
            is_mode=loss.is_mode,
            is_cap=loss.is_cap,
            loss_agg=loss.loss_agg,
            max_tokens=loss.max_tokens,
            std_normalize=loss.std_normalize,
            kl_coef=loss.kl_coef,
            kl_estimator=loss.kl_estimator,
            micro_batch_size=loss.micro_batch_size,
            max_grad_norm=loss.max_grad_norm,
        )
        self.hook = _ReplayForward(config.replay, temperature, config.share_prefixes)
        self.rank, self.world = rank, world
        self.fsdp = config.parallel == "fsdp"
        # experts that none of a rank's tokens reach get no gradient on that rank
        ddp = [DistributedDataParallelKwargs(find_unused_parameters=True)] if world > 1 else []
        accelerator = Accelerator(cpu=not torch.cuda.is_available(), kwargs_handlers=ddp)
        if self.fsdp and world > 1:  # accelerate has joined the process group by now
            shard_model(model, accelerator.device)
        self.optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=config.lr,
            betas=(config.betas[0], config.betas[1]),
            weight_decay=config.weight_decay,
        )
        optimizer: Any = self.optimizer
        if self.fsdp and world > 1:  # the model is used as sharded; only the optimizer wraps
            optimizer = accelerator.prepare_optimizer(self.optimizer)
        self.grpo = GRPOTrainer(
            model,
            optimizer,
            self.grpo_config,
            accelerator,
            forward_fn=self.hook,
            policy_version=policy_version,
            fsdp=self.fsdp,
        )

    @property
    def policy_version(self) -> int:
        return self.grpo.policy_version

    @policy_version.setter
    def policy_version(self, value: int) -> None:
        self.grpo.policy_version = value

    def step(self, groups: Sequence[Sequence[Sample]]) -> dict[str, Any]:
        """One optimizer step on ``groups``; returns GRPO metrics plus agreement figures."""
        batch = collate(groups)
        if self.world > 1:  # this rank's whole groups; rows renumbered within the share
            batch = shard_by_group(batch, self.rank, self.world)
            batch.extras["row"] = torch.arange(batch.num_sequences)
        version = self.policy_version
        self.hook.captured.clear()
        same = (batch.policy_version == version) & (batch.extras["max_version"] == version)
        with batch_invariant(self.deterministic):
            if self.reference is not None:
                batch.ref_logprobs = self._reference_logprobs(batch)
            checks = self._routing_check(batch, same)  # before the update: same weights
            # one process stands in for `processes` ranks: the same sum, the same bits
            shards = self.config.processes if self.world == 1 else 1
            metrics: dict[str, Any] = dict(self.grpo.step(batch, shards=shards))
            if self.config.updates_per_step > 1 and metrics["step_applied"]:
                metrics.update(self._more_updates(batch, shards))
        metrics.update(checks)
        metrics.update(self._mismatch(batch, same))
        # one pass over the batch: tokens fed, and the prefix tokens sharing did not repeat
        metrics["trainer_tokens_fed"] = sum(p.tokens_fed for p in self.hook.captured)
        metrics["trainer_tokens_shared"] = sum(p.tokens_shared for p in self.hook.captured)
        return {
            k: (v if not isinstance(v, float) or math.isfinite(v) else None)
            for k, v in metrics.items()
        }

    def _reference_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """The reference policy's log-probs [B, T] of ``batch``, micro-batch by micro-batch."""
        assert self.reference is not None
        out = torch.zeros_like(batch.rollout_logprobs)
        device = next(self.reference.parameters()).device
        size = self.config.loss.micro_batch_size
        with torch.no_grad():
            for start in range(0, batch.num_sequences, size):
                rows = torch.arange(start, min(start + size, batch.num_sequences))
                lp, _, _ = self.hook.logprobs(self.reference, batch.select(rows).to(device))
                out[rows, : lp.shape[1]] = lp.to(out.device)
        return out

    def _more_updates(self, batch: RolloutBatch, shards: int) -> dict[str, Any]:
        """Updates 2.. of a step on the same batch, the first pass's log-probs as the old
        policy; the version advances once for the step. The first pass's capture is kept
        for the mismatch check (it alone scored with the rollout's weights)."""
        first = list(self.hook.captured)
        old = torch.zeros_like(batch.rollout_logprobs)
        for p in first:
            old[p.rows] = p.logprobs
        batch.old_logprobs = old
        version = self.policy_version
        for _ in range(self.config.updates_per_step - 1):
            self.hook.captured.clear()
            last = self.grpo.step(batch, shards=shards)
        self.policy_version = version
        self.hook.captured[:] = first
        batch.old_logprobs = None
        return {
            "updates": self.config.updates_per_step,
            "clip_frac_last_update": last.get("clip_frac", 0.0),
            "ratio_mean_last_update": last.get("ratio_mean", 1.0),
        }

    def _mismatch(self, batch: RolloutBatch, same: torch.Tensor) -> dict[str, Any]:
        """Trainer (gradient pass) vs engine log-probs on the samples the update scored."""
        out: dict[str, Any] = {"same_version_samples": int(same.sum())}
        rows = [int(r) for p in self.hook.captured for r in p.rows.tolist()]
        lps = [p.logprobs for p in self.hook.captured]
        if rows:
            trainer_lp = torch.zeros_like(batch.rollout_logprobs)
            trainer_lp[torch.tensor(rows)] = torch.cat(lps)
            seen = torch.zeros(batch.num_sequences, dtype=torch.bool)
            seen[torch.tensor(rows)] = True
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

    def _routing_check(self, batch: RolloutBatch, same: torch.Tensor) -> dict[str, Any]:
        """A few rows (same-version first) re-scored with and without replay, no gradient."""
        out: dict[str, Any] = {}
        n_check = self.config.routing_check_rows
        if n_check > 0:
            order = torch.argsort((~same).to(torch.int8), stable=True)[:n_check]
            sub = batch.select(order)
            with torch.no_grad():
                lp_free, ids_free, counts = score(self.model, sub, "none", self.hook.temperature)
                _, ids_replay, _ = score(self.model, sub, "R3", self.hook.temperature)
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
                    [
                        sub.extras["routes"][i, :n].long()
                        for i, n in enumerate(counts)
                        if sub_same[i]
                    ]
                )
                if sum(sel_counts):
                    out["routing_agreement_same_version"] = routing_agreement(
                        same_ids, same_rec
                    ).per_decision
        return out

    def state(self) -> dict[str, Any]:
        return {"policy_version": self.policy_version}
