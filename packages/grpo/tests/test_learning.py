"""GRPO learns: a tiny autoregressive policy goes from chance to >= 0.9 reward on a verifiable task.

The task: given two symbols, emit them reversed (reward 1 if exactly right, else 0; chance is
1/36 because the policy samples over the whole vocabulary). Rollouts are one optimizer step
stale, as in async RL: the batch trained on at step k was sampled by the weights of step k-1.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from accelerate import Accelerator

from tandem.grpo import GRPOConfig, GRPOStep

MAX_STEPS = 300
# One seed by default; more seeds (checked across dozens while developing) under -m slow.
SEEDS = [0, *(pytest.param(s, marks=pytest.mark.slow) for s in (1, 2, 3))]


def train(
    tiny: ModuleType, config: GRPOConfig, seed: int, stale_as_old: bool
) -> tuple[float, float]:
    """Returns (mean reward of the first batch, mean reward of a fresh evaluation batch)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = tiny.TinyPolicy()
    trainer = GRPOStep(
        model, torch.optim.Adam(model.parameters(), lr=3e-2), config, Accelerator(cpu=True)
    )
    first = None
    pending = None
    version = 0  # the caller counts policy versions
    recent: list[float] = []
    for _ in range(MAX_STEPS):
        batch = tiny.sample_reverse_task(model, 32, 8, gen, version)
        if stale_as_old:  # the PPO/GSPO ratio is taken against the behaviour policy
            batch.old_logprobs = batch.rollout_logprobs
        first = batch.rewards.mean().item() if first is None else first
        recent = [*recent[-4:], batch.rewards.mean().item()]
        if len(recent) == 5 and sum(recent) / 5 >= 0.97:
            break
        if pending is not None:
            metrics = trainer.step(pending, version=version)
            assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values()), metrics
            version += int(metrics["step_applied"])
        pending = batch
    final = tiny.sample_reverse_task(model, 256, 4, gen).rewards.mean().item()
    return first, final


@pytest.mark.parametrize("seed", SEEDS)
def test_dr_grpo_learns_reverse_task(tiny: ModuleType, seed: int) -> None:
    config = GRPOConfig(loss_agg="constant", max_tokens=tiny.RESPONSE, micro_batch_size=64)
    first, final = train(tiny, config, seed, stale_as_old=False)
    assert first < 0.15, f"initial reward {first} is not near chance (1/36)"
    assert final >= 0.9, f"Dr. GRPO reached only {final} mean reward"


@pytest.mark.parametrize("seed", SEEDS)
def test_gspo_learns_reverse_task(tiny: ModuleType, seed: int) -> None:
    config = GRPOConfig(
        ratio_level="sequence",
        loss_agg="seq-mean-token-mean",
        clip_eps_low=3e-4,
        clip_eps_high=4e-4,
        is_mode="none",
        micro_batch_size=64,
    )
    first, final = train(tiny, config, seed, stale_as_old=True)
    assert first < 0.15, f"initial reward {first} is not near chance (1/36)"
    assert final >= 0.9, f"GSPO reached only {final} mean reward"
