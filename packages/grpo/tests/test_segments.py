"""Segment chains: an episode summarised into several rows trains as the unsplit episode.

An episode is cut into segments the way a self-summarising agent's would be: each piece of
its tokens becomes a row with its own (masked) prompt, and every segment carries the
episode's id, group and reward (helpers: segment_chains.py). These tests check, against
float64 loops over episodes and against the unsplit batch, that advantages count episodes,
that every aggregation gives the unsplit loss and gradients (also with an episode's
segments in different micro-batches), that rows without episode ids train bit for bit as
before, and that inconsistent segments are rejected. The trainer step on segments is in
test_segments_step.py.
"""

from __future__ import annotations

import statistics
from types import ModuleType
from typing import Any

import pytest
import torch
from accelerate import Accelerator

from tandem.grpo import (
    GRPOConfig,
    GRPOError,
    GRPOStep,
    LossNormalizer,
    RolloutBatch,
    episode_loss_tokens,
    failed_groups,
    group_advantages,
    nonconstant_groups,
    policy_loss,
)
from tandem.grpo.advantages import batch_advantages

AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "constant"]


# --- advantages --------------------------------------------------------------------------


def naive_episode_advantages(
    rewards: list[float],
    groups: list[int],
    episodes: list[int],
    std_normalize: bool,
    leave_one_out: bool,
    eps: float = 1e-6,
) -> list[float]:
    """Per row: its episode's advantage, from the rewards of the *episodes* of its group."""
    reward_of: dict[int, float] = {}
    group_of: dict[int, int] = {}
    for r, g, e in zip(rewards, groups, episodes, strict=True):
        reward_of[e], group_of[e] = r, g
    out = []
    for e in episodes:
        members = [reward_of[f] for f in reward_of if group_of[f] == group_of[e]]
        if len(members) < 2:
            out.append(0.0)
            continue
        if leave_one_out:
            others = [reward_of[f] for f in reward_of if group_of[f] == group_of[e] and f != e]
            a = reward_of[e] - sum(others) / len(others)
        else:
            a = reward_of[e] - sum(members) / len(members)
        if std_normalize:
            a = a / (statistics.stdev(members) + eps)
        out.append(a)
    return out


def segment_rows(
    seed: int, num_episodes: int = 16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rewards, group ids, episode ids) of rows that are 1-3 shuffled segments per episode."""
    gen = torch.Generator().manual_seed(seed)
    ep_groups = torch.randint(0, 5, (num_episodes,), generator=gen)
    ep_groups[-1] = 99  # a group of one episode (split below into several segments)
    ep_rewards = torch.rand(num_episodes, generator=gen, dtype=torch.float64).round(decimals=1)
    ep_ids = torch.randperm(200, generator=gen)[:num_episodes] - 100  # negative ids too
    segments = torch.randint(1, 4, (num_episodes,), generator=gen)
    segments[-1] = 3
    rows = torch.repeat_interleave(torch.arange(num_episodes), segments)
    rows = rows[torch.randperm(rows.numel(), generator=gen)]
    return ep_rewards[rows], ep_groups[rows], ep_ids[rows]


@pytest.mark.parametrize("std_normalize", [False, True])
@pytest.mark.parametrize("leave_one_out", [False, True])
def test_group_advantages_count_episodes_not_rows(std_normalize: bool, leave_one_out: bool) -> None:
    rewards, groups, episodes = segment_rows(0)
    got = group_advantages(
        rewards,
        group_ids=groups,
        std_normalize=std_normalize,
        leave_one_out=leave_one_out,
        episode_ids=episodes,
    )
    want = naive_episode_advantages(
        rewards.tolist(), groups.tolist(), episodes.tolist(), std_normalize, leave_one_out
    )
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-9, atol=1e-9)
    assert (got[groups == 99] == 0).all()  # one episode in three segments: no baseline
    rowwise = group_advantages(
        rewards, group_ids=groups, std_normalize=std_normalize, leave_one_out=leave_one_out
    )
    assert not torch.allclose(rowwise, got)  # counting segments would weigh split episodes more


def test_group_filters_count_episodes() -> None:
    rewards, groups, episodes = segment_rows(1)
    got = nonconstant_groups(rewards, group_ids=groups, episode_ids=episodes)
    for i in range(rewards.numel()):
        members = {rewards[j].item() for j in range(rewards.numel()) if groups[j] == groups[i]}
        assert got[i].item() == (len(members) > 1)
    # one episode of three failed segments is a group of one, not a failed group of three
    failed = torch.zeros_like(rewards)
    lone = groups == 99
    assert failed_groups(failed, group_ids=groups)[lone].all()
    assert not failed_groups(failed, group_ids=groups, episode_ids=episodes)[lone].any()
    got = failed_groups(failed, group_ids=groups, episode_ids=episodes)
    for i in range(rewards.numel()):
        members = {episodes[j].item() for j in range(rewards.numel()) if groups[j] == groups[i]}
        assert got[i].item() == (len(members) >= 2)


# --- the loss on plain tensors -----------------------------------------------------------

B, T = 6, 8
CUTS = {0: [4], 2: [3, 5], 3: [6], 4: [1, 2, 7], 5: [5]}


def loss_inputs(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    mask = torch.rand(B, T, generator=gen) < 0.7
    mask[:, 0] = False
    mask[0] = False  # an empty episode (cut in two empty segments)
    mask[1] = False
    mask[1, 3] = True  # a one-token episode
    return {
        "logp": logp,
        "old": logp + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.3,
        "ref": logp + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.3,
        "adv": torch.randn(B, generator=gen, dtype=torch.float64),
        "isw": torch.rand(B, T, generator=gen, dtype=torch.float64) * 2,
        "ent": torch.rand(B, T, generator=gen, dtype=torch.float64),
        "mask": mask,
    }


def naive_episode_loss(seg: dict[str, torch.Tensor], cfg: GRPOConfig) -> torch.Tensor:
    """The loss of segment rows from a loop over episodes: each episode's token terms are
    pooled, then aggregated with the episode as the sequence."""
    lo, hi = 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high
    terms: dict[int, list[torch.Tensor]] = {}
    mask = seg["mask"]
    for r in range(mask.shape[0]):
        pooled = terms.setdefault(int(seg["episode_ids"][r]), [])
        a = seg["adv"][r].item()
        for t in range(mask.shape[1]):
            if not mask[r, t]:
                continue
            ratio = torch.exp(seg["logp"][r, t] - seg["old"][r, t])
            term = torch.maximum(-a * ratio, -a * torch.clamp(ratio, lo, hi)) * seg["isw"][r, t]
            term = term + cfg.kl_coef * (seg["logp"][r, t] - seg["ref"][r, t])  # k1
            pooled.append(term - cfg.entropy_coef * seg["ent"][r, t])
    zero = torch.zeros((), dtype=torch.float64)
    episodes = list(terms.values())
    nonempty = [e for e in episodes if e]
    if cfg.loss_agg == "token-mean":
        tokens = [x for e in episodes for x in e]
        return sum(tokens, zero) / len(tokens)
    if cfg.loss_agg == "seq-mean-token-mean":
        return sum((sum(e, zero) / len(e) for e in nonempty), zero) / len(nonempty)
    if cfg.loss_agg == "seq-mean-token-sum":
        return sum((sum(e, zero) for e in nonempty), zero) / len(nonempty)
    return sum((sum(e, zero) / cfg.max_tokens for e in episodes), zero) / len(episodes)


def segments_of(inp: dict[str, torch.Tensor], split: Any, logp: torch.Tensor) -> dict:
    """The segment rows of ``inp``, with ``logp`` (a leaf of the unsplit shape) gathered."""
    out = {k: split.take(inp[k], 0.0) for k in ("old", "ref", "isw", "ent")}
    out["logp"] = split.take(logp, 0.0)
    out["mask"] = split.mask(inp["mask"])
    out["adv"] = inp["adv"][split.src_row]
    out["episode_ids"] = split.episode_ids()
    return out


def loss_of(
    x: dict[str, torch.Tensor], cfg: GRPOConfig, **kwargs: Any
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`policy_loss` on the tensors of ``x`` (reference, IS weights and entropy included)."""
    logp = kwargs.pop("logp", x["logp"])
    return policy_loss(
        logp, x["old"], x["adv"], x["mask"], config=cfg, ref_logprobs=x["ref"],
        is_weights=x["isw"], entropy=x["ent"], **kwargs,
    )  # fmt: skip


def loss_config(agg: str) -> GRPOConfig:
    return GRPOConfig(loss_agg=agg, max_tokens=T, kl_coef=0.1, entropy_coef=0.01)  # type: ignore[arg-type]


@pytest.mark.parametrize("agg", AGGS)
def test_split_episode_gives_the_unsplit_loss_and_gradient(chains: ModuleType, agg: str) -> None:
    inp = loss_inputs(0)
    cfg = loss_config(agg)
    split = chains.cut(B, T, CUTS, torch.Generator().manual_seed(1))
    assert split.src_row.numel() == B + sum(len(c) for c in CUTS.values())

    whole = inp["logp"].clone().requires_grad_()
    loss, metrics = loss_of(inp, cfg, logp=whole)
    loss.backward()
    assert metrics["clip_frac"].item() > 0  # clipping is exercised

    pieces = inp["logp"].clone().requires_grad_()
    seg = segments_of(inp, split, pieces)
    got, _ = loss_of(seg, cfg, episode_ids=seg["episode_ids"])
    got.backward()

    naive_leaf = inp["logp"].clone().requires_grad_()
    want = naive_episode_loss(segments_of(inp, split, naive_leaf), cfg)
    want.backward()
    assert got.item() == pytest.approx(want.item(), rel=1e-9, abs=1e-12)
    assert loss.item() == pytest.approx(want.item(), rel=1e-9, abs=1e-12)
    torch.testing.assert_close(pieces.grad, naive_leaf.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(whole.grad, naive_leaf.grad, rtol=1e-9, atol=1e-12)

    if agg != "token-mean":  # the same rows without episode ids are other sequences
        rows, _ = loss_of(seg, cfg)
        assert rows.item() != pytest.approx(want.item(), rel=1e-6)


@pytest.mark.parametrize("agg", AGGS)
def test_micro_batches_split_inside_episodes_add_up(chains: ModuleType, agg: str) -> None:
    """Global counts and per-row episode token counts make micro-batch losses (and their
    gradients) sum to the loss of the batch, with segments of one episode in different ones."""
    inp = loss_inputs(2)
    cfg = loss_config(agg)
    split = chains.cut(B, T, CUTS, torch.Generator().manual_seed(3))
    leaf = inp["logp"].clone().requires_grad_()
    seg = segments_of(inp, split, leaf)
    ids = seg["episode_ids"]
    full, _ = loss_of(seg, cfg, episode_ids=ids)
    (want_grad,) = torch.autograd.grad(full, leaf, retain_graph=True)

    norm = LossNormalizer.from_mask(seg["mask"], ids)
    seq_tokens = episode_loss_tokens(seg["mask"], ids)
    sizes = [2, 5, ids.numel() - 7]
    assert chains.spans_micro_batches(ids, sizes)
    total, partial_without_counts = torch.zeros((), dtype=torch.float64), 0.0
    for rows in torch.arange(ids.numel()).split(sizes):
        micro = {k: seg[k][rows] for k in ("logp", "old", "adv", "mask", "ref", "isw", "ent")}
        part, _ = loss_of(micro, cfg, normalizer=norm, seq_tokens=seq_tokens[rows])
        total = total + part
        alone, _ = loss_of(micro, cfg, normalizer=norm, episode_ids=ids[rows])
        partial_without_counts += alone.item()
    (got_grad,) = torch.autograd.grad(total, leaf)
    assert total.item() == pytest.approx(full.item(), rel=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-15)
    if agg == "seq-mean-token-mean":  # a micro-batch alone cannot know its episodes' lengths
        assert partial_without_counts != pytest.approx(full.item(), rel=1e-6)


# --- without episode ids nothing changes -------------------------------------------------


@pytest.mark.parametrize("agg", AGGS)
def test_rows_as_their_own_episodes_give_identical_bits(chains: ModuleType, agg: str) -> None:
    """Ids that make every row its own episode take the episode code path; it must give the
    bits of the path without ids (sorted ids, so the per-episode order is the row order)."""
    cfg = chains.config(agg, "grpo-kl-reward")
    batch = chains.episodes_batch()
    singles = RolloutBatch(
        **{**batch.__dict__, "episode_ids": torch.arange(batch.num_sequences) * 5 - 3}
    )
    assert torch.equal(batch_advantages(batch, cfg), batch_advantages(singles, cfg))
    plain, m_plain = chains.run(batch, cfg)
    same, m_same = chains.run(singles, cfg)
    assert all(torch.equal(plain[k], same[k]) for k in plain)
    assert m_plain == m_same

    inp = loss_inputs(4)
    grads = []
    for ids in (None, torch.arange(B)):
        logp = inp["logp"].clone().requires_grad_()
        loss, _ = loss_of(inp, loss_config(agg), logp=logp, episode_ids=ids)
        loss.backward()
        grads.append((loss.detach(), logp.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


# --- bad inputs --------------------------------------------------------------------------


def test_inconsistent_segments_raise_naming_the_field(chains: ModuleType) -> None:
    segments = chains.split_batch(chains.episodes_batch())
    ids = segments.episode_ids
    assert ids is not None
    row = int((ids == 1000).nonzero()[1, 0])  # the second segment of episode 0

    def changed(name: str, value: torch.Tensor) -> RolloutBatch:
        return RolloutBatch(**{**segments.__dict__, name: value})

    rewards = segments.rewards.clone()
    rewards[row] += 0.5
    with pytest.raises(GRPOError, match="rewards differ"):
        changed("rewards", rewards).validate()
    groups = segments.group_ids.clone()
    groups[row] = 11
    with pytest.raises(GRPOError, match="group_ids differ"):
        changed("group_ids", groups).validate()
    adv = torch.arange(ids.numel(), dtype=torch.float64)
    with pytest.raises(GRPOError, match="advantages differ"):
        changed("advantages", adv).validate()
    with pytest.raises(GRPOError, match="episode_ids must be an integer"):
        changed("episode_ids", ids.double()).validate()
    with pytest.raises(GRPOError, match="episode_ids has shape"):
        changed("episode_ids", ids[:-1]).validate()
    cfg = GRPOConfig()
    step = GRPOStep(
        chains.Bigram(),
        torch.optim.SGD(chains.Bigram().parameters(), lr=0.1),
        cfg,
        Accelerator(cpu=True),
    )
    with pytest.raises(GRPOError, match="rewards differ"):
        step.step(changed("rewards", rewards))
    with pytest.raises(GRPOError, match="group_ids"):
        group_advantages(segments.rewards, group_size=2, episode_ids=ids)
    with pytest.raises(GRPOError, match="rewards differ"):
        group_advantages(rewards, group_ids=segments.group_ids, episode_ids=ids)
