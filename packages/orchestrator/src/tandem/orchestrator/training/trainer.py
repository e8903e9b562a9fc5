"""The RL trainer: GRPO on scored groups with router replay, and train/rollout agreement checks.

`tandem.grpo.GRPOStep` does the update (Dr. GRPO advantages, clipped policy loss,
truncated importance weights against the rollout log-probs); `scoring.ReplayScorer` is its
forward hook, re-scoring each trajectory with the engine's experts (R3), the trainer's own
(R2), or free. Each step also measures how far the trainer is from the engine
(`agreement`). The trainer keeps no policy version: the RL loop passes the version each
step starts from.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Sequence
from typing import Any

import torch

from tandem.grpo import GRPOStep, RolloutBatch, shard_by_group
from tandem.moe_determinism import MoETransformer, batch_invariant, stock_kernels
from tandem.orchestrator.config import TrainerConfig
from tandem.orchestrator.training.agreement import kl_to_start, mismatch, routing_check
from tandem.orchestrator.training.collate import collate
from tandem.orchestrator.training.scoring import ReplayScorer
from tandem.orchestrator.training.sharding import shard_model
from tandem.orchestrator.training.weights import state_for_sync
from tandem.orchestrator.wire import Sample


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
    and one more copy of the weights per rank. Without the penalty, ``kl_check_rows`` > 0
    keeps it too and scores that many rows per step, for the KL-to-start metric alone. ``vocab``: the tokenizer's ids; rows of a
    padded embedding past them are not scored, as the engine never samples them.
    """

    def __init__(
        self,
        model: MoETransformer,
        config: TrainerConfig,
        *,
        deterministic: bool = True,
        temperature: float = 1.0,
        vocab: int | None = None,
        rank: int = 0,
        world: int = 1,
        reference: dict[str, torch.Tensor] | None = None,
    ) -> None:
        from accelerate import Accelerator, DistributedDataParallelKwargs

        self.config = config
        self.deterministic = deterministic
        self.model = model
        # copied before sharding: every rank scores its share of the batch with whole weights
        keep_start = config.loss.kl_coef > 0 or config.kl_check_rows > 0
        self.reference = frozen_copy(model, reference) if keep_start else None
        forward_kl = config.loss.kl_coef > 0 and config.loss.kl_estimator == "forward"
        self.hook = ReplayScorer(
            config.replay,
            temperature,
            config.share_prefixes,
            vocab,
            entropy_grad=config.loss.entropy_coef > 0,
            reference=self.reference if forward_kl else None,
            logits_chunk=config.logits_chunk,
        )
        model.activation_checkpointing = config.activation_checkpointing
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
        self.grpo = GRPOStep(
            model, optimizer, config.loss, accelerator, forward_fn=self.hook, fsdp=self.fsdp
        )

    def step(self, groups: Sequence[Sequence[Sample]], version: int) -> dict[str, Any]:
        """One optimizer step on ``groups`` from the weights of policy ``version``; returns
        GRPO metrics plus agreement figures."""
        batch = collate(groups)
        if self.world > 1:  # this rank's whole groups; rows renumbered within the share
            batch = shard_by_group(batch, self.rank, self.world)
            batch.extras["row"] = torch.arange(batch.num_sequences)
        self.hook.captured.clear()
        self.hook.replayed.clear()
        same = (batch.policy_version == version) & (batch.extras["max_version"] == version)
        with batch_invariant(self.deterministic):
            start_rows, start_lp = self._start_logprobs(batch)
            # before the update: the weights the rollouts' version had
            checks = routing_check(
                self.model,
                batch,
                same,
                self.config.routing_check_rows,
                self.hook.temperature,
                self.hook.vocab,
            )
            # one process stands in for `processes` ranks: the same sum, the same bits
            shards = self.config.processes if self.world == 1 else 1
            metrics: dict[str, Any] = dict(self.grpo.step(batch, version=version, shards=shards))
            if self.config.updates_per_step > 1 and metrics["step_applied"]:
                metrics.update(self._more_updates(batch, version, shards))
        metrics.update(checks)
        metrics.update(mismatch(batch, same, self.hook.captured))
        if start_lp is not None:
            metrics.update(kl_to_start(batch, start_rows, start_lp, self.hook.captured))
        # one pass over the batch: tokens fed, and the prefix tokens sharing did not repeat
        metrics["trainer_tokens_fed"] = sum(p.tokens_fed for p in self.hook.captured)
        metrics["trainer_tokens_shared"] = sum(p.tokens_shared for p in self.hook.captured)
        metrics["trainer_replay"] = "+".join(sorted(self.hook.replayed)) or self.config.replay
        return {
            k: (v if not isinstance(v, float) or math.isfinite(v) else None)
            for k, v in metrics.items()
        }

    def _start_logprobs(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rows scored by the start policy and their log-probs: every row, kept as the
        KL penalty's reference, with ``loss.kl_coef`` > 0 and a sampled estimator; else the
        first ``kl_check_rows`` (none when 0), for the KL-to-start metric alone (the forward
        KL's reference scores each micro-batch inside the hook)."""
        rows = torch.arange(batch.num_sequences)
        if self.reference is None:
            return rows[:0], None
        if self.config.loss.kl_coef > 0 and self.hook.reference is None:
            batch.ref_logprobs = self._reference_logprobs(batch)  # the sampled KL estimators'
            return rows, batch.ref_logprobs
        rows = rows[: self.config.kl_check_rows]
        return rows, self._reference_logprobs(batch.select(rows))

    def _reference_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """The reference policy's log-probs [B, T] of ``batch``, micro-batch by micro-batch."""
        assert self.reference is not None
        out = torch.zeros_like(batch.rollout_logprobs)
        device = next(self.reference.parameters()).device
        size = self.config.loss.micro_batch_size
        with torch.no_grad():
            for start in range(0, batch.num_sequences, size):
                rows = torch.arange(start, min(start + size, batch.num_sequences))
                scored, _ = self.hook.scores(self.reference, batch.select(rows).to(device))
                lp = scored.logprobs
                out[rows, : lp.shape[1]] = lp.to(out.device)
        return out

    def _more_updates(self, batch: RolloutBatch, version: int, shards: int) -> dict[str, Any]:
        """Updates 2.. of a step on the same batch, the first pass's log-probs as the old
        policy; the version advances once for the step (the caller's count). The first pass's
        capture is kept for the mismatch check (it alone scored with the rollout's weights):
        no engine ever sampled from the weights the later passes score, so their bits are
        compared with nothing, and they run torch's own kernels unless
        ``exact_later_updates``."""
        first = list(self.hook.captured)
        old = torch.zeros_like(batch.rollout_logprobs)
        for p in first:
            old[p.rows] = p.logprobs
        batch.old_logprobs = old
        with contextlib.nullcontext() if self.config.exact_later_updates else stock_kernels():
            for _ in range(self.config.updates_per_step - 1):
                self.hook.captured.clear()
                last = self.grpo.step(batch, version=version, shards=shards)
        self.hook.captured[:] = first
        batch.old_logprobs = None
        return {
            "updates": self.config.updates_per_step,
            "clip_frac_last_update": last.get("clip_frac", 0.0),
            "ratio_mean_last_update": last.get("ratio_mean", 1.0),
        }

    # -- the `Trainer` interface of the local backend ----------------------------------------
    def weights(self) -> dict[str, torch.Tensor]:
        return state_for_sync(self.model)

    def checkpoint_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return self.model.state_dict(), self.optimizer.state_dict()

    def close(self) -> None:
        return None
