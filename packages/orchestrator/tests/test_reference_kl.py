"""The KL penalty's reference policy: the run's starting weights, frozen."""

from __future__ import annotations

import torch

from tandem.moe_determinism import MoETransformer, batch_invariant, compare_logprobs
from tandem.orchestrator.config import LossConfig, TrainerConfig
from tandem.orchestrator.policy import clone_model
from tandem.orchestrator.trainer import RLTrainer, collate


def _groups(chat, tiny_policy, make_engine, helpers):
    p, obs = helpers.prompt, helpers.observation
    episodes = [
        (p(chat, f"task {g}"), [obs(chat, "1\tdef f(): pass")], 10 * g + i)
        for g in range(2)
        for i in range(4)
    ]
    samples = helpers.drive(make_engine(tiny_policy), chat, episodes)
    return [samples[:4], samples[4:]]


def _config(kl_coef: float) -> TrainerConfig:
    return TrainerConfig(lr=3e-3, routing_check_rows=0, loss=LossConfig(kl_coef=kl_coef))


def _distance(model: MoETransformer, start: dict[str, torch.Tensor]) -> float:
    return float(
        sum((p.detach() - start[n]).square().sum() for n, p in model.named_parameters()).sqrt()
    )


def test_reference_scores_as_the_engine_did_and_stays_put(
    chat, tiny_policy, make_engine, helpers
) -> None:
    groups = _groups(chat, tiny_policy, make_engine, helpers)
    start = {k: v.clone() for k, v in tiny_policy.state_dict().items()}
    trainer = RLTrainer(clone_model(tiny_policy), _config(0.1))
    first = trainer.step(groups)
    assert first["kl"] == 0.0  # the policy is the reference before its first update
    second = trainer.step(groups)
    assert second["kl"] > 0.0  # now it has moved away from it
    assert _distance(trainer.model, start) > 0
    assert trainer.reference is not None
    for name, value in trainer.reference.state_dict().items():
        assert torch.equal(value, start[name]), name
    assert not any(p.requires_grad for p in trainer.reference.parameters())
    # an independent computation of the reference's log-probs: the engine's, which sampled
    # these tokens with the starting weights
    batch = collate(groups)
    with batch_invariant(True):  # as the engine and the trainer's step run
        ref = trainer._reference_logprobs(batch)
    cmp = compare_logprobs(ref, batch.rollout_logprobs, batch.loss_mask)
    assert cmp.tokens > 0 and cmp.max_abs_diff == 0.0


def test_the_penalty_keeps_the_policy_nearer_the_reference(
    chat, tiny_policy, make_engine, helpers
) -> None:
    groups = _groups(chat, tiny_policy, make_engine, helpers)
    start = {k: v.clone() for k, v in tiny_policy.state_dict().items()}
    kl = {}
    for coef in (0.0, 5.0):
        trainer = RLTrainer(clone_model(tiny_policy), _config(coef))
        for _ in range(6):
            trainer.step(groups)
        probe = RLTrainer(clone_model(trainer.model), _config(1.0), reference=start)
        batch = collate(groups)
        ours = probe._reference_logprobs(batch)  # the start's log-probs, via `reference`
        now = RLTrainer(clone_model(trainer.model), _config(1.0))._reference_logprobs(batch)
        kl[coef] = compare_logprobs(now, ours, batch.loss_mask).kl_k3
    assert kl[0.0] > 0
    assert kl[5.0] < 0.8 * kl[0.0]


def test_without_a_penalty_there_is_no_reference(tiny_policy) -> None:
    assert RLTrainer(clone_model(tiny_policy), _config(0.0)).reference is None
