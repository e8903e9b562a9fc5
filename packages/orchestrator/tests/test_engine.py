"""The embedded engine against the trainer: same log-prob bits, same experts, same weights."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest
import torch

from tandem.delta_sync import LocalStore
from tandem.moe_determinism import batch_invariant
from tandem.orchestrator.config import TrainerConfig
from tandem.orchestrator.inference.embedded.engine import EngineError
from tandem.orchestrator.runtime.threads import SpareCores, torch_threads
from tandem.orchestrator.training.collate import collate
from tandem.orchestrator.training.scoring import score
from tandem.orchestrator.training.trainer import RLTrainer
from tandem.orchestrator.training.weights import WeightPublisher, state_for_sync, weights_equal


def _episodes(chat, h):
    prompt, observation = h.prompt, h.observation
    return [
        (prompt(chat, "bug in clamp"), [observation(chat, "file text\n1\tdef f(): pass")], 11),
        (
            prompt(chat, "the second task is longer than the first one"),
            [observation(chat, "ok")],
            12,
        ),
        (prompt(chat, "x"), [observation(chat, "a"), observation(chat, "bb")], 13),
    ]


# torch's default thread count, 1 and 2; the engine runs with one and the trainer with the
# next (cyclically), so the two sides never share a count: threads are a speed setting only.
_COUNTS = sorted({1, 2, torch.get_num_threads()})
THREAD_PAIRS = [(n, _COUNTS[(i + 1) % len(_COUNTS)]) for i, n in enumerate(_COUNTS)]


@pytest.mark.parametrize(
    ("engine_threads", "trainer_threads"), THREAD_PAIRS, ids=[f"{e}-{t}" for e, t in THREAD_PAIRS]
)
def test_rollout_logprobs_equal_trainer_bit_for_bit(
    chat, tiny_policy, make_engine, helpers, engine_threads: int, trainer_threads: int
) -> None:
    engine = make_engine(tiny_policy)
    with torch_threads(engine_threads):
        samples = helpers.drive(engine, chat, _episodes(chat, helpers))
    assert all(s.routes.shape[0] == len(s.tokens) - 1 for s in samples)
    batch = collate([samples[:2], samples[2:]])
    with torch.no_grad(), batch_invariant(), torch_threads(trainer_threads):
        replayed, _, _ = score(tiny_policy, batch, "R3")
        free, free_ids, counts = score(tiny_policy, batch, "none")
    mask = batch.loss_mask
    assert int(mask.sum()) > 10
    # Bit-for-bit: compare the float32 bit patterns, not values within a tolerance.
    rollout_bits = batch.rollout_logprobs[mask].view(torch.int32)
    assert torch.equal(replayed[mask].view(torch.int32), rollout_bits)
    assert torch.equal(free[mask].view(torch.int32), rollout_bits)
    recorded = torch.cat([batch.extras["routes"][i, :n].long() for i, n in enumerate(counts)])
    assert torch.equal(free_ids.sort(-1).values, recorded.sort(-1).values)  # 100% agreement


@pytest.mark.parametrize(
    ("engine_threads", "trainer_threads"), THREAD_PAIRS, ids=[f"{e}-{t}" for e, t in THREAD_PAIRS]
)
def test_trainer_step_reports_zero_mismatch_and_full_agreement(
    chat, tiny_policy, make_engine, helpers, engine_threads: int, trainer_threads: int
) -> None:
    engine = make_engine(tiny_policy)
    with torch_threads(engine_threads):
        samples = helpers.drive(
            engine, chat, _episodes(chat, helpers) + _episodes(chat, helpers)[:1]
        )
    trainer = RLTrainer(tiny_policy, TrainerConfig(lr=1e-3, routing_check_rows=4))
    with torch_threads(trainer_threads):
        metrics = trainer.step([samples[:2], samples[2:]], 0)
    assert metrics["step_applied"] == 1.0
    assert metrics["same_version_samples"] == 4
    assert metrics["mismatch_tokens"] > 0
    assert metrics["mismatch_max_abs"] == 0.0 and metrics["mismatch_frac_differ"] == 0.0
    assert metrics["routing_agreement_free"] == 1.0
    assert metrics["routing_agreement_replay"] == 1.0


def test_a_trainer_that_changes_its_thread_count_layer_by_layer_matches_the_engine(
    chat, tiny_policy, make_engine, helpers
) -> None:
    """`SpareCores` switches the trainer between 1 and 2 threads before every layer (forward
    and backward); the products' bits do not depend on the count, so the step still scores
    every token as the single-threaded engine did."""
    engine = make_engine(tiny_policy)
    with torch_threads(1):
        samples = helpers.drive(engine, chat, _episodes(chat, helpers))
    trainer = RLTrainer(tiny_policy, TrainerConfig(lr=1e-3, routing_check_rows=2))
    turns = itertools.count()
    counts: list[int] = []
    cores = SpareCores(1, 2, lambda: next(turns) % 3 == 0)
    detach = cores.attach(tiny_policy)
    tiny_policy.layers[0].register_forward_hook(lambda *_: counts.append(torch.get_num_threads()))
    with torch_threads(1):
        metrics = trainer.step([samples[:2], samples[2:]], 0)
    detach()
    assert set(counts) == {1, 2} and cores.switches > 2
    assert metrics["mismatch_tokens"] > 0
    assert metrics["mismatch_max_abs"] == 0.0 and metrics["mismatch_frac_differ"] == 0.0
    assert metrics["routing_agreement_replay"] == 1.0


def test_tempered_logprobs_equal_trainer_bit_for_bit(
    chat, tiny_policy, make_engine, helpers
) -> None:
    """Below temperature 1 the engine reports log-probs of the tempered distribution; the
    trainer scores with the same temperature and gets the same bits (and a step reports 0)."""
    engine = make_engine(tiny_policy, temperature=0.7)
    samples = helpers.drive(engine, chat, _episodes(chat, helpers))
    batch = collate([samples[:2], samples[2:]])
    mask = batch.loss_mask
    with torch.no_grad(), batch_invariant():
        tempered, _, _ = score(tiny_policy, batch, "R3", temperature=0.7)
        plain, _, _ = score(tiny_policy, batch, "R3")
    rollout_bits = batch.rollout_logprobs[mask].view(torch.int32)
    assert torch.equal(tempered[mask].view(torch.int32), rollout_bits)
    assert not torch.equal(plain[mask], batch.rollout_logprobs[mask])  # temperature matters
    trainer = RLTrainer(tiny_policy, TrainerConfig(lr=1e-3, routing_check_rows=2), temperature=0.7)
    metrics = trainer.step([samples[:2], samples[2:]], 0)
    assert metrics["mismatch_tokens"] > 0 and metrics["mismatch_max_abs"] == 0.0


def test_sampling_does_not_depend_on_the_batch(chat, tiny_policy, make_engine, helpers) -> None:
    episodes = _episodes(chat, helpers)
    together = helpers.drive(make_engine(tiny_policy), chat, episodes)
    alone = helpers.drive(make_engine(tiny_policy), chat, [episodes[1]])
    assert alone[0].tokens == together[1].tokens
    assert alone[0].logprobs == together[1].logprobs


def _next_version(policy, tmp_path):
    """Publish ``policy`` as version 0, nudge its weights, publish version 1 and return
    version 1 prepared for a subscriber at version 0 (the policy keeps the new weights)."""
    publisher = WeightPublisher(LocalStore(str(tmp_path)), policy, anchor_every=10)
    publisher.publish(0)
    sub = publisher.subscriber(0)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 1e-2)
    publisher.publish(1)
    return sub.prepare()


def test_weights_swapped_mid_turn_through_delta_sync(
    chat, tiny_policy, make_engine, tmp_path, helpers
) -> None:
    engine = make_engine(tiny_policy, max_new_tokens=8)
    prepared = _next_version(tiny_policy, tmp_path)

    def stage(step: int) -> None:
        if step == 3:
            engine.stage_update(prepared)

    samples = helpers.drive(
        engine, chat, [(helpers.prompt(chat, "task"), [], 5)], max_new_tokens=8, between_steps=stage
    )
    generated = [v for v in samples[0].versions if v >= 0]
    assert generated[:3] == [0, 0, 0] and set(generated[3:]) == {1}
    assert (samples[0].min_version, samples[0].max_version) == (0, 1)
    assert engine.version == 1
    assert weights_equal(engine.state, state_for_sync(tiny_policy))


def test_context_overflow_is_a_clear_error(chat, tiny_policy, make_engine, helpers) -> None:
    engine = make_engine(tiny_policy, max_len=64)
    slot = engine.acquire()
    with pytest.raises(EngineError, match="do not fit"):
        engine.submit(slot, list(range(70)), torch.Generator(), 4)


def _same_samples(a, b) -> bool:
    return all(
        x.tokens == y.tokens
        and x.logprobs == y.logprobs  # floats compared exactly
        and x.versions == y.versions
        and np.array_equal(x.routes, y.routes)
        and (x.min_version, x.max_version) == (y.min_version, y.max_version)
        for x, y in zip(a, b, strict=True)
    )


def test_shared_prefixes_are_copied_without_changing_a_bit(
    chat, tiny_policy, make_engine, helpers
) -> None:
    """A group's samples start with one prompt: one computes it, the others copy its keys,
    values and routes (they wait one step for it), and every sample is what it is without
    sharing: tokens, log-probs, versions and routes."""
    task = helpers.prompt(chat, "the same task for the whole group, long enough to share")
    obs = helpers.observation(chat, "file text\n1\tdef f(): pass")
    episodes = [(task, [obs], seed) for seed in (21, 22, 23, 24)]
    episodes.append((helpers.prompt(chat, "another task"), [obs], 25))
    plain = make_engine(tiny_policy, share_prefixes=False)
    shared = make_engine(tiny_policy)
    want = helpers.drive(plain, chat, episodes)
    got = helpers.drive(shared, chat, episodes)
    assert _same_samples(got, want)
    assert all(s.routes.shape[0] == len(s.tokens) - 1 for s in got)
    assert plain.stats.tokens_reused == 0
    # three of the four copy all of the prompt but the token they sample from
    assert shared.stats.tokens_reused >= 3 * (len(task) - 1)
    assert shared.stats.tokens_fed == plain.stats.tokens_fed - shared.stats.tokens_reused
    # and their copies of the prompt's whole KV splits name one slot as their origin, the
    # split attention read once per step for all four
    origins = shared.cache.origins
    named = origins != torch.arange(origins.shape[0])[:, None]
    assert int(named.sum()) >= 3 * ((len(task) - 1) // shared.cache.split) > 0


def test_a_slot_taken_while_a_step_runs_changes_nothing_the_step_reads(
    chat, tiny_policy, make_engine, helpers
) -> None:
    """Episodes take slots on the event loop while a step runs in the serving thread. Taking
    one must not clear its cache there and then: clearing rewrites the origins other slots
    read their shared KV splits from and the prefix index a step copies from, and here the
    slot taken is the very donor the running step copied its prompt from. The slot is cleared
    by the next step, before it admits anything, and every sample is what it is without
    sharing."""
    task = helpers.prompt(chat, "a prompt long enough to share a few whole KV splits of it")
    engine = make_engine(tiny_policy, max_slots=2)
    helpers.drive(engine, chat, [(task, [], 41)])  # slot 0 computes it, then is released
    forward, taken = engine._forward, []

    def forward_while_a_slot_is_taken(batch):
        if not taken:  # the first step: slot 1 has just copied the prompt from slot 0
            seen = (engine.cache.lengths.clone(), engine.cache.origins.clone())
            versions = engine.prefixes.versions.copy()
            thread = threading.Thread(target=lambda: taken.append(engine.acquire()))
            thread.start()
            thread.join()
            assert taken == [0] and engine.context_length(0) == 0
            assert torch.equal(engine.cache.lengths, seen[0])
            assert torch.equal(engine.cache.origins, seen[1])
            assert np.array_equal(engine.prefixes.versions, versions)
        return forward(batch)

    engine._forward = forward_while_a_slot_is_taken
    got = helpers.drive(engine, chat, [(task, [], 42)])
    assert taken == [0] and engine.stats.tokens_reused == len(task) - 1
    assert int(engine.cache.lengths[0]) == 0 and engine.prefixes.versions[0] == -1
    assert (engine.cache.origins[1] == 1).all()  # its copied splits are its own again
    assert _same_samples(got, helpers.drive(make_engine(tiny_policy), chat, [(task, [], 42)]))
    engine.release(0)


def test_no_prefix_is_shared_across_weight_versions(
    chat, tiny_policy, make_engine, tmp_path, helpers
) -> None:
    """A released slot's cache stays a donor while its version is current; after an update
    the same prompt is computed afresh (and equals a fresh engine's on the new weights)."""
    task = helpers.prompt(chat, "a prompt played twice")
    engine = make_engine(tiny_policy)
    helpers.drive(engine, chat, [(task, [], 31)])
    again = helpers.drive(engine, chat, [(task, [], 32)])
    assert engine.stats.tokens_reused == len(task) - 1  # from the released slot
    assert _same_samples(again, helpers.drive(make_engine(tiny_policy), chat, [(task, [], 32)]))

    engine.stage_update(_next_version(tiny_policy, tmp_path))
    engine.apply_pending()
    reused = engine.stats.tokens_reused
    after = helpers.drive(engine, chat, [(task, [], 33)])
    assert engine.stats.tokens_reused == reused  # version 0's rows are not version 1's
    fresh = make_engine(tiny_policy)
    fresh.version = 1
    assert _same_samples(after, helpers.drive(fresh, chat, [(task, [], 33)]))
