"""`GRPOStep.step`: split invariance, equality with a direct loss, dynamic sampling, edge cases."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from accelerate import Accelerator

from tandem.grpo import (
    GRPOConfig,
    GRPOError,
    GRPOStep,
    RolloutBatch,
    group_advantages,
    importance_weights,
    next_token_logprobs,
    policy_loss,
)


def make(tiny: ModuleType, seed: int = 0) -> tuple[torch.nn.Module, RolloutBatch]:
    torch.manual_seed(seed)
    model = tiny.TinyPolicy().double()
    gen = torch.Generator().manual_seed(seed + 100)
    batch = tiny.sample_reverse_task(model.float(), 6, 4, gen)
    model.double()
    batch.rewards = torch.rand(24, generator=gen, dtype=torch.float64).round(decimals=1)
    batch.rewards[4:8] = 1.0  # an all-equal group
    batch.rollout_logprobs = batch.rollout_logprobs.double() + 0.2 * torch.randn(
        24, tiny.LENGTH, generator=gen, dtype=torch.float64
    )
    batch.ref_logprobs = batch.rollout_logprobs + 0.1
    batch.loss_mask[3, 3] = False  # a one-token response
    batch.loss_mask[5] = False  # an empty response
    return model, batch


def run_step(
    model: torch.nn.Module, batch: RolloutBatch, config: GRPOConfig, lr: float = 0.1
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    trainer = GRPOStep(
        model, torch.optim.SGD(model.parameters(), lr=lr), config, Accelerator(cpu=True)
    )
    metrics = trainer.step(batch)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, metrics


@pytest.mark.parametrize(
    "agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "constant"]
)
def test_update_does_not_depend_on_micro_batch_size(tiny: ModuleType, agg: str) -> None:
    results = []
    for micro in (1, 5, 64):
        model, batch = make(tiny)
        cfg = GRPOConfig(
            loss_agg=agg,
            micro_batch_size=micro,
            max_tokens=2,
            kl_coef=0.1,  # type: ignore[arg-type]
            max_grad_norm=None,
        )
        results.append(run_step(model, batch, cfg))
    (p0, m0), *rest = results
    for params, metrics in rest:
        for name in p0:
            torch.testing.assert_close(params[name], p0[name], rtol=1e-10, atol=1e-12)
        for key in ("loss", "kl", "clip_frac", "grad_norm", "is_weight_mean", "is_ess"):
            assert metrics[key] == pytest.approx(m0[key], rel=1e-9, abs=1e-12), key


def test_step_equals_direct_loss_on_whole_batch(tiny: ModuleType) -> None:
    """Independent path: advantages, IS weights and policy_loss on the kept rows, autograd, SGD."""
    cfg = GRPOConfig(
        loss_agg="token-mean",
        micro_batch_size=3,
        kl_coef=0.05,
        max_grad_norm=None,
        is_mode="token_mis",
        is_cap=1.5,
    )
    model, batch = make(tiny)
    ref_model = make(tiny)[0]
    params, metrics = run_step(model, batch, cfg, lr=0.1)

    keep = torch.ones(24, dtype=torch.bool)
    keep[4:8] = False
    adv = group_advantages(batch.rewards, group_size=4)[keep]
    kept = batch.select(keep)
    logp = next_token_logprobs(ref_model(kept.input_ids), kept.input_ids)
    weights, _ = importance_weights(
        logp.detach(), kept.rollout_logprobs, kept.loss_mask, "token_mis", 1.5
    )
    loss, _ = policy_loss(
        logp,
        logp.detach(),
        adv,
        kept.loss_mask,
        config=cfg,
        ref_logprobs=kept.ref_logprobs,
        is_weights=weights,
    )
    loss.backward()
    with torch.no_grad():
        for name, p in ref_model.named_parameters():
            torch.testing.assert_close(params[name], p - 0.1 * p.grad, rtol=1e-10, atol=1e-12)
    assert metrics["loss"] == pytest.approx(loss.item(), rel=1e-10)
    assert metrics["tokens"] == kept.loss_mask.sum().item()
    assert metrics["groups"] == 6 and metrics["groups_kept"] == 5


def test_skipping_equal_groups_equals_removing_them(tiny: ModuleType) -> None:
    cfg = GRPOConfig(loss_agg="token-mean", max_grad_norm=None, micro_batch_size=4)
    model, batch = make(tiny)
    skipped, m_skip = run_step(model, batch, cfg)
    model2, batch2 = make(tiny)
    keep = torch.ones(24, dtype=torch.bool)
    keep[4:8] = False
    removed, _ = run_step(model2, batch2.select(keep), cfg)
    for name in skipped:
        torch.testing.assert_close(skipped[name], removed[name], rtol=1e-10, atol=1e-12)
    model3, batch3 = make(tiny)
    kept_all, m_keep = run_step(
        model3,
        batch3,
        GRPOConfig(loss_agg="token-mean", max_grad_norm=None, skip_equal_reward_groups=False),
    )
    assert m_keep["tokens"] > m_skip["tokens"]  # kept: the equal group joins the normaliser
    assert not torch.allclose(kept_all["inp.weight"], skipped["inp.weight"])


def test_all_groups_equal_skips_the_step(tiny: ModuleType) -> None:
    model, batch = make(tiny)
    batch.rewards = torch.ones(24, dtype=torch.float64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = GRPOStep(
        model, torch.optim.SGD(model.parameters(), lr=0.1), GRPOConfig(), Accelerator(cpu=True)
    )
    metrics = trainer.step(batch)
    assert metrics["step_applied"] == 0.0 and metrics["groups_kept"] == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("is_mode", ["token_tis", "token_mis", "sequence_mis", "geometric_mis"])
def test_extreme_rollout_logprobs_keep_the_step_finite(tiny: ModuleType, is_mode: str) -> None:
    model, batch = make(tiny)
    batch.rollout_logprobs[0, 3] = float("-inf")
    batch.rollout_logprobs[1, 3] = batch.rollout_logprobs[1, 3] + 80
    batch.rollout_logprobs[2, 4] = batch.rollout_logprobs[2, 4] - 80
    batch.ref_logprobs[8, 3] = float("-inf")
    cfg = GRPOConfig(is_mode=is_mode, kl_coef=0.1, kl_estimator="k3", micro_batch_size=4)  # type: ignore[arg-type]
    params, metrics = run_step(model, batch, cfg)
    assert all(torch.isfinite(v).all() for v in params.values())
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values()), metrics
    assert metrics["is_clipped_frac"] > 0 and metrics["step_applied"] == 1.0


def test_metrics_report_staleness_and_rewards(tiny: ModuleType) -> None:
    model, batch = make(tiny)
    batch.policy_version = torch.tensor([3] * 12 + [5] * 12)
    trainer = GRPOStep(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        GRPOConfig(),
        Accelerator(cpu=True),
    )
    metrics = trainer.step(batch, version=6)
    assert metrics["staleness_mean"] == pytest.approx(2.0) and metrics["staleness_max"] == 3.0
    assert metrics["reward_mean"] == pytest.approx(batch.rewards.mean().item())
    assert metrics["step_applied"] == 1.0 and "policy_version" not in metrics
    # without a version, staleness is measured against the newest trajectory's
    model, batch = make(tiny)
    batch.policy_version = torch.tensor([3] * 12 + [5] * 12)
    trainer = GRPOStep(
        model, torch.optim.SGD(model.parameters(), lr=0.1), GRPOConfig(), Accelerator(cpu=True)
    )
    metrics = trainer.step(batch)
    assert metrics["staleness_mean"] == pytest.approx(1.0) and metrics["staleness_max"] == 2.0


def test_custom_forward_hook_and_extras_are_sliced(tiny: ModuleType) -> None:
    model, batch = make(tiny)
    batch.extras["row"] = torch.arange(24)
    seen: list[int] = []

    def hook(m: torch.nn.Module, micro: RolloutBatch) -> torch.Tensor:
        assert micro.extras["row"].shape[0] == micro.num_sequences
        seen.extend(micro.extras["row"].tolist())
        return next_token_logprobs(m(micro.input_ids), micro.input_ids)

    trainer = GRPOStep(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        GRPOConfig(micro_batch_size=5),
        Accelerator(cpu=True),
        forward_fn=hook,
    )
    trainer.step(batch)
    assert sorted(seen) == [r for r in range(24) if not 4 <= r < 8]


def test_bad_batches_and_hooks_raise_clear_errors(tiny: ModuleType) -> None:
    model, batch = make(tiny)
    trainer = GRPOStep(
        model, torch.optim.SGD(model.parameters(), lr=0.1), GRPOConfig(), Accelerator(cpu=True)
    )
    bad = batch.select(slice(None))
    bad.loss_mask = bad.loss_mask.clone()
    bad.loss_mask[0, 0] = True
    with pytest.raises(GRPOError, match="first token"):
        trainer.step(bad)
    with pytest.raises(GRPOError, match="rewards has shape"):
        trainer.step(RolloutBatch(**{**batch.__dict__, "rewards": torch.zeros(3)}))
    trainer.forward_fn = lambda m, b: next_token_logprobs(m(b.input_ids), b.input_ids)[:, 1:]
    with pytest.raises(GRPOError, match="shape"):
        trainer.step(batch)
    trainer.forward_fn = lambda m, b: next_token_logprobs(m(b.input_ids), b.input_ids).detach()
    with pytest.raises(GRPOError, match="without gradient"):
        trainer.step(batch)


def test_failed_groups_train_with_their_advantage_and_the_rest_as_before(tiny: ModuleType) -> None:
    """A group that failed everywhere (rewards all 0) trains with ``failed_group_advantage``
    on every sample; an all-1 group is still skipped. Checked against the direct loss on the
    kept rows with hand-made advantages."""
    cfg = GRPOConfig(
        loss_agg="token-mean", max_grad_norm=None, is_mode="none", failed_group_advantage=-0.3
    )
    model, batch = make(tiny)
    batch.rewards[12:16] = 0.0  # an all-failed group
    ref_model = make(tiny)[0]
    params, metrics = run_step(model, batch, cfg, lr=0.1)

    keep = torch.ones(24, dtype=torch.bool)
    keep[4:8] = False  # the all-1 group
    adv = group_advantages(batch.rewards, group_size=4)
    adv[12:16] = -0.3
    kept = batch.select(keep)
    logp = next_token_logprobs(ref_model(kept.input_ids), kept.input_ids)
    loss, _ = policy_loss(logp, logp.detach(), adv[keep], kept.loss_mask, config=cfg)
    loss.backward()
    with torch.no_grad():
        for name, p in ref_model.named_parameters():
            torch.testing.assert_close(params[name], p - 0.1 * p.grad, rtol=1e-10, atol=1e-12)
    assert metrics["groups_kept"] == 5
    off, m_off = run_step(make(tiny)[0], batch, GRPOConfig(loss_agg="token-mean"), lr=0.1)
    assert m_off["groups_kept"] == 4  # without the option the failed group is skipped too
    assert not torch.equal(off["inp.weight"], params["inp.weight"])
