"""Scoring a group's common prefix once: the same log-prob bits as scoring each rollout
whole (and as the engine's), and the same update up to summation order."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from tandem.moe_determinism import batch_invariant
from tandem.orchestrator.config import TrainerConfig
from tandem.orchestrator.policy import clone_model
from tandem.orchestrator.training.collate import collate
from tandem.orchestrator.training.prefix_scoring import SharedLayout, score_shared
from tandem.orchestrator.training.scoring import score
from tandem.orchestrator.training.trainer import RLTrainer
from tandem.orchestrator.wire import Sample


def _common_prefix(group: list[Sample]) -> int:
    """Leading fed tokens every rollout of ``group`` has in common (the token, its target and
    its recorded experts), counted from the samples themselves; each keeps one of its own."""
    first = group[0]
    limit = min(len(s.tokens) for s in group) - 2
    n = 0
    while n < limit and all(
        s.tokens[n : n + 2] == first.tokens[n : n + 2]
        and np.array_equal(s.routes[n], first.routes[n])
        for s in group
    ):
        n += 1
    return n


def _group_samples(chat, tiny_policy, make_engine, helpers):
    """A group of four rollouts of one prompt (two of them the same seed: identical rows),
    and a group of one with another prompt."""
    p, obs = helpers.prompt, helpers.observation
    prompt = p(chat, "There is a bug in `gcd` in `toolbelt.py`; fix it.")
    observations = [obs(chat, "1\tdef gcd(a, b):\n2\t    return a")]
    episodes = [(prompt, observations, seed) for seed in (1, 2, 3, 3)]
    episodes.append((p(chat, "another task"), [obs(chat, "ok")], 9))
    samples = helpers.drive(make_engine(tiny_policy), chat, episodes)
    return [samples[:4], samples[4:]], len(prompt)


@pytest.mark.parametrize("logits_chunk", [0, 7])
@pytest.mark.parametrize("replay", ["R3", "none", "R2"])
def test_shared_scoring_is_bitwise_whole_scoring_and_the_engine(
    chat, tiny_policy, make_engine, helpers, replay: str, logits_chunk: int
) -> None:
    groups, prompt_len = _group_samples(chat, tiny_policy, make_engine, helpers)
    batch = collate(groups)
    layout = SharedLayout(batch, match_routes=replay == "R3")
    # the prompt at least is fed once for the group of four instead of four times
    assert layout.shared_tokens >= 3 * (prompt_len - 2)
    fed = int((batch.attention_mask.sum(1) - 1).sum())
    assert len(layout.tokens) == fed - layout.shared_tokens
    with torch.no_grad(), batch_invariant():
        scored = score_shared(tiny_policy, batch, replay, logits_chunk=logits_chunk)
        shared = scored.logprobs
        whole, _, _ = score(tiny_policy, batch, replay)
        if logits_chunk:  # logits 7 tokens at a time: the same bits, entropy too
            unchunked = score_shared(tiny_policy, batch, replay)
            assert torch.equal(scored.entropy, unchunked.entropy)
    mask = batch.loss_mask
    assert int(mask.sum()) > 20
    assert torch.equal(shared[mask].view(torch.int32), whole[mask].view(torch.int32))
    assert torch.equal(
        shared[mask].view(torch.int32), batch.rollout_logprobs[mask].view(torch.int32)
    )
    # every real position is scored (padding and position 0 stay 0)
    real = batch.attention_mask.clone()
    real[:, 0] = False
    assert torch.equal(shared[real], whole[real])
    assert not bool(shared[~real].any())


def test_differing_recorded_routes_end_the_shared_prefix(
    chat, tiny_policy, make_engine, helpers
) -> None:
    """Under R3 a token counts as shared only if every rollout recorded the same experts for
    it (rollouts of one group may have been prefilled by different weight versions)."""
    groups, prompt_len = _group_samples(chat, tiny_policy, make_engine, helpers)
    batch = collate(groups)
    cut = prompt_len // 2
    routes = batch.extras["routes"]
    routes[1, cut] = (routes[1, cut].long() + 1) % 4  # another (valid) choice of experts
    assert SharedLayout(batch, match_routes=True).shared_tokens == 3 * cut
    assert SharedLayout(batch, match_routes=False).shared_tokens >= 3 * (prompt_len - 2)
    with torch.no_grad(), batch_invariant():
        shared = score_shared(tiny_policy, batch, "R3").logprobs
        whole, _, _ = score(tiny_policy, batch, "R3")
    real = batch.attention_mask.clone()
    real[:, 0] = False
    assert torch.equal(shared[real].view(torch.int32), whole[real].view(torch.int32))


def test_step_with_shared_prefixes_matches_step_without(
    chat, tiny_policy, make_engine, helpers
) -> None:
    """One GRPO step each way from the same weights: zero mismatch with sharing, and the same
    gradient (Adam's first moment after one step) up to the order of the sums."""
    groups, _ = _group_samples(chat, tiny_policy, make_engine, helpers)
    moments = []
    for share in (True, False):
        model = clone_model(tiny_policy)
        config = TrainerConfig(lr=1e-2, routing_check_rows=0, share_prefixes=share)
        trainer = RLTrainer(model, config)
        metrics = trainer.step(groups, 0)
        assert metrics["step_applied"] == 1.0
        assert metrics["mismatch_max_abs"] == 0.0 and metrics["mismatch_tokens"] > 0
        assert metrics["trainer_replay"] == "R3"  # the engine's routes, every sample
        # the group of one has no signal: the trainer scores the group of four only
        fed = sum(len(s.tokens) - 1 for s in groups[0])
        shared = (len(groups[0]) - 1) * _common_prefix(groups[0]) if share else 0
        assert shared > 0 or not share
        assert (metrics["trainer_tokens_fed"], metrics["trainer_tokens_shared"]) == (
            fed - shared,
            shared,
        )
        state = trainer.optimizer.state
        moments.append({n: state[p]["exp_avg"].clone() for n, p in model.named_parameters()})
    for name, shared in moments[0].items():
        whole = moments[1][name]
        assert bool(whole.abs().max() > 0), name  # every parameter got a gradient
        torch.testing.assert_close(
            shared, whole, rtol=1e-4, atol=1e-5 * float(whole.abs().max()), msg=name
        )


def test_rows_without_a_token_to_score_give_zeros(chat, tiny_policy, make_engine, helpers) -> None:
    """One-token rows predict nothing: zeros, not an error from an empty pack."""
    groups, _ = _group_samples(chat, tiny_policy, make_engine, helpers)
    short = [
        msgspec.structs.replace(
            s, tokens=s.tokens[:1], loss_mask=[0], logprobs=[0.0], routes=s.routes[:0]
        )
        for s in groups[0][:2]
    ]
    batch = collate([short])
    assert len(SharedLayout(batch, match_routes=True).tokens) == 0
    assert torch.equal(score_shared(tiny_policy, batch, "R3").logprobs, torch.zeros(2, 1))


def test_samples_without_routes_are_replayed_from_the_trainers_own_routes(
    chat, tiny_policy, make_engine, helpers
) -> None:
    """R3 needs the engine's experts; samples whose engine reported none (vLLM on a CPU) are
    scored as R2 would score them, bit for bit, and the step says so."""
    groups, _ = _group_samples(chat, tiny_policy, make_engine, helpers)
    unknown = [
        [msgspec.structs.replace(s, routes=np.full(s.routes.shape, -1, np.int16)) for s in g]
        for g in groups
    ]
    runs = {}
    for name, replay, played in (("R3, none known", "R3", unknown), ("R2", "R2", groups)):
        model = clone_model(tiny_policy)
        config = TrainerConfig(lr=1e-2, routing_check_rows=2, replay=replay)
        metrics = RLTrainer(model, config).step(played, 0)
        runs[name] = (metrics, {n: p.detach().clone() for n, p in model.named_parameters()})
    (fallback, after_fallback), (r2, after_r2) = runs.values()
    assert fallback["trainer_replay"] == r2["trainer_replay"] == "R2"
    assert fallback["mismatch_max_abs"] == r2["mismatch_max_abs"]
    assert all(torch.equal(after_fallback[n], t) for n, t in after_r2.items())
    assert not any(k.startswith("routing_agreement") for k in fallback)  # nothing to compare
