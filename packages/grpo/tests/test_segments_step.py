"""`GRPOStep` on segment chains: the step on an episode's segments is the step on the episode.

With a bigram policy a segment scores its tokens as the unsplit episode does, so splitting
must change nothing: parameters (and the metrics that count episodes) agree for every
aggregation, with the segments shuffled over micro-batches and over emulated processes.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from tandem.grpo import GRPOConfig, RolloutBatch, shard_by_group
from tandem.grpo.advantages import batch_advantages

AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "constant"]
VARIANTS = ["dr-grpo", "grpo-kl-reward"]
SAME_METRICS = (
    "loss",
    "pg_loss",
    "tokens",
    "sequences",
    "groups",
    "groups_kept",
    "kl",
    "clip_frac",
    "is_weight_mean",
    "reward_mean",
    "advantage_abs_mean",
    "grad_norm",
)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("agg", AGGS)
def test_step_on_segments_equals_step_on_episodes(
    chains: ModuleType, agg: str, variant: str
) -> None:
    cfg = chains.config(agg, variant)
    batch = chains.episodes_batch()
    segments = chains.split_batch(batch)
    assert segments.episode_ids is not None
    kept = torch.isin(segments.group_ids, torch.tensor([10, 12] + [13] * (variant != "dr-grpo")))
    micro = [len(c) for c in torch.arange(int(kept.sum())).split(cfg.micro_batch_size)]
    assert chains.spans_micro_batches(segments.episode_ids[kept], micro)
    whole, m_whole = chains.run(batch, cfg)
    pieces, m_pieces = chains.run(segments, cfg)
    for name in whole:
        torch.testing.assert_close(pieces[name], whole[name], rtol=1e-9, atol=1e-12)
    assert not torch.equal(
        whole["table.weight"], chains.Bigram().double().state_dict()["table.weight"]
    )
    for key in SAME_METRICS:
        assert m_pieces[key] == pytest.approx(m_whole[key], rel=1e-9, abs=1e-12), key
    assert m_pieces["sequences"] == m_whole["groups_kept"] * chains.PER_GROUP  # episodes, not rows
    if cfg.max_grad_norm is not None:
        assert m_whole["grad_norm"] > cfg.max_grad_norm  # the clipping is engaged
    # honest: the same rows without episode ids (each segment an episode) train differently
    rows, _ = chains.run(RolloutBatch(**{**segments.__dict__, "episode_ids": None}), cfg)
    assert not torch.allclose(rows["table.weight"], whole["table.weight"], rtol=1e-6)


@pytest.mark.parametrize("agg", AGGS)
def test_emulated_processes_keep_episodes_whole(chains: ModuleType, agg: str) -> None:
    segments = chains.split_batch(chains.episodes_batch())
    assert segments.episode_ids is not None
    owners = [shard_by_group(segments, rank, 3) for rank in range(3)]
    seen = [set(s.episode_ids.tolist()) for s in owners if s.episode_ids is not None]
    assert sum(s.num_sequences for s in owners) == segments.num_sequences
    assert sum(len(s) for s in seen) == len(set(segments.episode_ids.tolist()))  # disjoint
    cfg = chains.config(agg, "grpo-kl-reward")
    whole, _ = chains.run(chains.episodes_batch(), cfg, shards=2)
    pieces, _ = chains.run(segments, cfg, shards=2)
    for name in whole:
        torch.testing.assert_close(pieces[name], whole[name], rtol=1e-9, atol=1e-12)


def test_episode_kl_penalty_is_the_sum_over_segments(chains: ModuleType) -> None:
    cfg = chains.config("constant", "grpo-kl-reward")
    batch = chains.episodes_batch()
    segments = chains.split_batch(batch)
    whole = batch_advantages(batch, cfg)
    ids = segments.episode_ids
    assert ids is not None
    torch.testing.assert_close(
        batch_advantages(segments, cfg), whole[chains.episode_of(ids)], rtol=1e-9, atol=1e-12
    )


def test_mean_normalized_segments_carry_their_episodes_advantage(chains: ModuleType) -> None:
    """Mean normalisation divides by the group's mean over episodes, not segments: each
    episode's value against a per-group loop over the episodes' rewards."""
    cfg = GRPOConfig(mean_normalize=True)
    batch = chains.episodes_batch()
    whole = batch_advantages(batch, cfg)
    rewards, groups = batch.rewards.tolist(), batch.group_ids.tolist()
    for i, r in enumerate(rewards):
        members = [rewards[j] for j in range(len(rewards)) if groups[j] == groups[i]]
        mean = sum(members) / len(members)
        assert whole[i].item() == pytest.approx((r - mean) / max(mean, 1 / len(members)))
    assert whole.abs().max() > batch_advantages(batch, GRPOConfig()).abs().max()
    segments = chains.split_batch(batch)
    ids = segments.episode_ids
    assert ids is not None
    torch.testing.assert_close(
        batch_advantages(segments, cfg), whole[chains.episode_of(ids)], rtol=1e-9, atol=1e-12
    )
