"""Several optimizer updates per RL step (PPO epochs) on one batch."""

from __future__ import annotations

import pytest

from tandem.orchestrator.config import ConfigValueError, TrainerConfig
from tandem.orchestrator.policy import clone_model
from tandem.orchestrator.training.trainer import RLTrainer


def _displacement(before, model) -> float:
    return float(
        sum((p.detach() - before[n]).square().sum() for n, p in model.named_parameters()).sqrt()
    )


def test_second_update_uses_the_first_pass_as_old_policy(tiny_policy, two_groups) -> None:
    groups = two_groups
    before = {n: p.detach().clone() for n, p in tiny_policy.named_parameters()}
    moved = {}
    for updates in (1, 2):
        model = clone_model(tiny_policy)
        config = TrainerConfig(lr=1e-3, routing_check_rows=0, updates_per_step=updates)
        trainer = RLTrainer(model, config)
        metrics = trainer.step(groups, 0)
        assert metrics["step_applied"] == 1.0  # one step (one published version) either way
        assert metrics["mismatch_max_abs"] == 0.0  # checked on the first pass only
        moved[updates] = _displacement(before, model)
        if updates == 2:
            assert metrics["updates"] == 2
            # the ratio of the second update is new / first-pass log-probs: near 1 after one
            # small step, but not exactly 1 (the weights moved); with any other "old" policy
            # (zeros, say) it would be far from 1
            assert 0.9 < metrics["ratio_mean_last_update"] < 1.1
            assert metrics["ratio_mean_last_update"] != 1.0
    # Adam moves each weight by about lr per update: two updates, about twice as far
    assert 1.5 < moved[2] / moved[1] < 2.5


def test_updates_per_step_must_be_positive() -> None:
    with pytest.raises(ConfigValueError, match="updates_per_step"):
        TrainerConfig(updates_per_step=0)
