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


@pytest.mark.parametrize("exact", [False, True])
def test_later_updates_run_torch_kernels_unless_exact(tiny_policy, two_groups, exact) -> None:
    """Only the first pass is compared with the engine: the later ones leave the invariant
    kernels (on the trainer's thread) unless ``exact_later_updates``; the step still lands
    where the all-invariant step does, up to float rounding."""
    from tandem.moe_determinism import is_batch_invariant

    config = TrainerConfig(
        lr=1e-3, routing_check_rows=0, updates_per_step=3, exact_later_updates=exact
    )
    trainer = RLTrainer(clone_model(tiny_policy), config)
    modes: list[bool] = []
    step = trainer.grpo.step

    def recording(*args, **kwargs):
        modes.append(is_batch_invariant())
        return step(*args, **kwargs)

    trainer.grpo.step = recording
    metrics = trainer.step(two_groups, 0)
    assert modes == [True, exact, exact]
    assert metrics["mismatch_max_abs"] == 0.0
    if not exact:  # the same step as the all-invariant one, up to float rounding
        reference = RLTrainer(
            clone_model(tiny_policy),
            TrainerConfig(
                lr=1e-3, routing_check_rows=0, updates_per_step=3, exact_later_updates=True
            ),
        )
        reference.step(two_groups, 0)
        start = dict(tiny_policy.named_parameters())
        apart = moved = 0.0
        for (name, got), want in zip(
            trainer.model.named_parameters(), reference.model.parameters(), strict=True
        ):
            apart += float((got - want).detach().square().sum())
            moved += float((want - start[name]).detach().square().sum())
        assert apart**0.5 < 0.01 * moved**0.5  # 3e-7 of the way here
