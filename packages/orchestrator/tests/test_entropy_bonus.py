"""The scoring pass's entropy: the step's metric against whole-row forwards, and the bonus."""

from __future__ import annotations

import pytest
import torch

from tandem.grpo import GRPOConfig
from tandem.moe_determinism import RouterReplay, RoutingTrace, batch_invariant
from tandem.orchestrator.config import TrainerConfig
from tandem.orchestrator.policy import clone_model
from tandem.orchestrator.training.collate import collate
from tandem.orchestrator.training.prefix_scoring import score_shared
from tandem.orchestrator.training.trainer import RLTrainer


def _trainer(policy, entropy_coef: float) -> RLTrainer:
    loss = GRPOConfig(entropy_coef=entropy_coef, max_tokens=512)
    return RLTrainer(clone_model(policy), TrainerConfig(lr=3e-3, routing_check_rows=0, loss=loss))


def _mean_entropy(model, groups) -> float:
    batch = collate(groups)
    with torch.no_grad(), batch_invariant(True):
        entropy = score_shared(model, batch, "R3").entropy
    return float(entropy[batch.loss_mask].mean())


def test_step_entropy_is_the_mean_over_loss_tokens_of_whole_row_entropies(
    tiny_policy, two_groups
) -> None:
    """The first step's ``entropy`` (the weights before its update) against float64
    entropies of each row's next-token distributions, from a forward of that row alone."""
    batch = collate(two_groups)
    fed = (batch.attention_mask.sum(1) - 1).tolist()
    values = []
    with torch.no_grad():
        for row, n in enumerate(fed):
            one = batch.select(torch.tensor([row]))
            trace = RoutingTrace.from_ids(
                one.extras["routes"][0, :n].numpy(), tiny_policy.config.num_experts
            )
            out = tiny_policy(
                one.input_ids[:, :n], torch.tensor([n]), routing=RouterReplay([trace])
            )
            logp = torch.log_softmax(out.logits[0].double(), -1)
            entropy = -(logp.exp() * logp).sum(-1)  # position t predicts token t + 1
            mask = one.loss_mask[0, 1 : n + 1]
            values += entropy[mask].tolist()
    metrics = _trainer(tiny_policy, 0.0).step(two_groups, 0)
    assert metrics["entropy"] == pytest.approx(sum(values) / len(values), rel=1e-5)


def test_an_entropy_bonus_keeps_the_policy_more_spread(tiny_policy, two_groups) -> None:
    """GRPO alone lowers the entropy on its tokens; with a bonus it is lowered by less than
    half as much."""
    start = _mean_entropy(tiny_policy, two_groups)
    change = {}
    for coef in (0.0, 5.0):
        trainer = _trainer(tiny_policy, coef)
        for version in range(4):
            trainer.step(two_groups, version)
        change[coef] = _mean_entropy(trainer.model, two_groups) - start
    assert change[0.0] < 0
    assert change[5.0] > 0.5 * change[0.0]
