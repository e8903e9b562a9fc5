"""The KL penalty's reference policy: the run's starting weights, frozen."""

from __future__ import annotations

import torch

from tandem.grpo import GRPOConfig
from tandem.moe_determinism import MoETransformer, batch_invariant, compare_logprobs
from tandem.orchestrator.config import TrainerConfig
from tandem.orchestrator.policy import clone_model
from tandem.orchestrator.training.collate import collate
from tandem.orchestrator.training.scoring import score
from tandem.orchestrator.training.trainer import RLTrainer


def _config(kl_coef: float) -> TrainerConfig:
    # k2: as a loss term its gradient is the on-policy gradient of KL(policy || reference)
    loss = GRPOConfig(kl_coef=kl_coef, kl_estimator="k2", clip_eps_high=0.28, max_tokens=512)
    return TrainerConfig(lr=3e-3, routing_check_rows=0, loss=loss)


def _logprobs(model: MoETransformer, groups) -> tuple[torch.Tensor, torch.Tensor]:
    """``model``'s log-probs of the groups' tokens (plain scoring, no prefix sharing)."""
    batch = collate(groups)
    with torch.no_grad(), batch_invariant(True):
        return score(model, batch, "R3")[0], batch.loss_mask


def test_reference_scores_as_the_engine_did_and_stays_put(tiny_policy, two_groups) -> None:
    start = {k: v.clone() for k, v in tiny_policy.state_dict().items()}
    trainer = RLTrainer(clone_model(tiny_policy), _config(0.1))
    first = trainer.step(two_groups, 0)
    assert first["kl"] == 0.0  # the policy is the reference before its first update
    second = trainer.step(two_groups, 1)
    assert second["kl"] > 0.0  # now it has moved away from it
    assert trainer.reference is not None
    for name, value in trainer.reference.state_dict().items():
        assert torch.equal(value, start[name]), name
    assert not any(p.requires_grad for p in trainer.reference.parameters())
    # an independent computation of the reference's log-probs: the engine's, which sampled
    # these tokens with the starting weights
    batch = collate(two_groups)
    with batch_invariant(True):  # as the engine and the trainer's step run
        ref = trainer._reference_logprobs(batch)
    cmp = compare_logprobs(ref, batch.rollout_logprobs, batch.loss_mask)
    assert cmp.tokens > 0 and cmp.max_abs_diff == 0.0


def test_the_penalty_keeps_the_policy_nearer_the_reference(tiny_policy, two_groups) -> None:
    start, mask = _logprobs(tiny_policy, two_groups)
    kl = {}
    for coef in (0.0, 5.0):
        trainer = RLTrainer(clone_model(tiny_policy), _config(coef))
        for version in range(6):
            trainer.step(two_groups, version)
        now, _ = _logprobs(trainer.model, two_groups)
        kl[coef] = compare_logprobs(now, start, mask).kl_k3
    assert kl[0.0] > 0
    assert kl[5.0] < 0.8 * kl[0.0]


def test_given_reference_weights_are_the_reference(tiny_policy, two_groups) -> None:
    """A resumed Ray rank starts from checkpointed weights and is handed the driver's
    reference: the reference is those weights, not the rank's."""
    start = {k: v.clone() for k, v in tiny_policy.state_dict().items()}
    moved = RLTrainer(clone_model(tiny_policy), _config(0.0))
    moved.step(two_groups, 0)
    rank = RLTrainer(clone_model(moved.model), _config(0.1), reference=start)
    assert rank.reference is not None
    for name, value in rank.reference.state_dict().items():
        assert torch.equal(value, start[name]), name
    assert any(not torch.equal(v, start[k]) for k, v in rank.model.state_dict().items())


def test_without_a_penalty_there_is_no_reference(tiny_policy) -> None:
    assert RLTrainer(clone_model(tiny_policy), _config(0.0)).reference is None
