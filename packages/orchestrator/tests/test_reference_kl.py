"""The KL penalty's reference policy: the run's starting weights, frozen."""

from __future__ import annotations

import pytest
import torch

from tandem.grpo import GRPOConfig
from tandem.moe_determinism import (
    MoETransformer,
    RouterReplay,
    RoutingTrace,
    batch_invariant,
    compare_logprobs,
)
from tandem.orchestrator.config import TrainerConfig
from tandem.orchestrator.policy import clone_model
from tandem.orchestrator.training.collate import collate
from tandem.orchestrator.training.prefix_scoring import score_shared
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


def _forward_config(kl_coef: float, updates: int = 1) -> TrainerConfig:
    loss = GRPOConfig(kl_coef=kl_coef, kl_estimator="forward", clip_eps_high=0.28, max_tokens=512)
    return TrainerConfig(lr=3e-3, routing_check_rows=0, updates_per_step=updates, loss=loss)


def test_the_hooks_forward_kl_is_the_whole_distributions_kl(tiny_policy, two_groups) -> None:
    """Every token's KL(reference || policy), from the shared-prefix pass, against float64
    sums over the vocabulary of two separate whole-row forwards (policy and reference,
    each replaying the engine's experts); a frozen copy of the policy gives exactly 0."""
    reference = clone_model(tiny_policy)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    batch = collate(two_groups)
    with torch.no_grad(), batch_invariant(True):
        scored = score_shared(tiny_policy, batch, "R3", reference=reference)
        same = score_shared(tiny_policy, batch, "R3", reference=clone_model(tiny_policy))
    assert scored.kl is not None and same.kl is not None
    assert torch.count_nonzero(same.kl) == 0
    fed = (batch.attention_mask.sum(1) - 1).tolist()
    checked = 0
    for row, n in enumerate(fed):
        one = batch.select(torch.tensor([row]))
        inputs = one.input_ids[:, :n]
        routes = one.extras["routes"][0, :n].numpy()
        logits = {}
        with torch.no_grad():
            for name, model in (("policy", tiny_policy), ("reference", reference)):
                trace = RoutingTrace.from_ids(routes, model.config.num_experts)
                out = model(inputs, torch.tensor([n]), routing=RouterReplay([trace], "R3"))
                logits[name] = out.logits[0].double()
        logq = torch.log_softmax(logits["policy"], -1)
        logp = torch.log_softmax(logits["reference"], -1)
        want = (logp.exp() * (logp - logq)).sum(-1)
        torch.testing.assert_close(scored.kl[row, 1 : n + 1].double(), want, atol=2e-5, rtol=1e-4)
        assert torch.count_nonzero(scored.kl[row, n + 1 :]) == 0  # padding
        checked += n
    assert checked > 50


def _forward_kl_to(start: MoETransformer, model: MoETransformer, groups) -> float:
    """Mean KL(start || model) per loss token of ``groups``, over the whole vocabulary."""
    batch = collate(groups)
    with torch.no_grad(), batch_invariant(True):
        kl = score_shared(model, batch, "R3", reference=start).kl
    assert kl is not None
    return float(kl[batch.loss_mask].mean())


def test_forward_kl_penalty_starts_at_zero_and_holds_the_policy_near_its_start(
    tiny_policy, two_groups
) -> None:
    """The penalty is measured where it acts: the forward KL to the start over the whole
    vocabulary (the sampled estimators would mostly see the tokens RL made likelier)."""
    kl = {}
    for coef in (0.0, 20.0):
        config = _forward_config(coef) if coef else _config(0.0)
        trainer = RLTrainer(clone_model(tiny_policy), config)
        for version in range(6):
            metrics = trainer.step(two_groups, version)
            if coef and version == 0:
                assert metrics["kl"] == 0.0  # the policy is its reference before an update
        if coef:
            assert metrics["kl"] > 0.0
        kl[coef] = _forward_kl_to(tiny_policy, trainer.model, two_groups)
    assert kl[0.0] > 0
    assert kl[20.0] < 0.5 * kl[0.0]


def test_kl_check_rows_measure_the_distance_to_the_start(tiny_policy, two_groups) -> None:
    """Without a penalty, ``kl_check_rows`` keeps the start policy to measure how far the
    policy moved: 0 before the first update, then the k3 of the trainer's pre-update
    log-probs against an independent scoring of the same rows by the start weights."""
    config = TrainerConfig(lr=3e-3, routing_check_rows=0, kl_check_rows=3)
    trainer = RLTrainer(clone_model(tiny_policy), config)
    first = trainer.step(two_groups, 0)
    assert first["kl_to_start_k3"] == 0.0 and first["kl_to_start_tokens"] > 0
    moved = clone_model(trainer.model)  # the weights the next step starts from
    second = trainer.step(two_groups, 1)
    batch = collate(two_groups)
    rows = torch.arange(3)
    with torch.no_grad(), batch_invariant(True):
        now = score(moved, batch, "R3")[0][rows]
        before = score(tiny_policy, batch, "R3")[0][rows]
    want = compare_logprobs(now, before, batch.loss_mask[rows])
    assert second["kl_to_start_tokens"] == want.tokens
    assert second["kl_to_start_k3"] == pytest.approx(want.kl_k3, rel=1e-5)
    assert second["kl_to_start_k3"] > 0
