"""Tied tensors (one tensor under two names): stored once, restored as aliases, and applied
onto subscribers that hold them tied or separately."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np
import pytest

from tandem.delta_sync import (
    DeltaSyncError,
    LocalStore,
    Publisher,
    Subscriber,
    apply_delta,
    decode_full,
    encode_delta,
    encode_full,
)

SMALL = {"chunk_bytes": 1 << 16, "shard_bytes": 1 << 17}


def _tied_state(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    embed = rng.normal(0, 0.02, (512, 64)).astype(ml_dtypes.bfloat16)
    # the Hugging Face default: the output head *is* the input embedding
    return {"embed": embed, "lm_head": embed, "norm": np.ones(64, np.float32)}


def _step(state: dict[str, np.ndarray], k: int) -> None:
    """Change the tied tensor (once: both names see it) and the norm, in place."""
    state["embed"].view(np.uint16)[k::37] += 1
    state["norm"][k] += 1


def test_publish_stores_a_tied_tensor_once_and_any_subscriber_pulls_it(
    local_store, same_bits
) -> None:
    state = _tied_state()
    pub = Publisher(local_store, **SMALL)
    tied_embed = np.zeros((512, 64), ml_dtypes.bfloat16)
    tied = {"embed": tied_embed, "lm_head": tied_embed, "norm": np.zeros(64, np.float32)}
    untied = {k: np.zeros_like(v) for k, v in state.items()}  # separate arrays, same names
    sub_tied, sub_untied = Subscriber(local_store), Subscriber(local_store)
    for v in range(4):
        if v:
            _step(state, v)
        report = pub.publish(v, state)
        assert report.dense_bytes == state["embed"].nbytes + state["norm"].nbytes  # once
        sub_tied.pull(tied)  # the delta pulls that used to raise BaseMismatchError
        sub_untied.pull(untied)
        same_bits(tied, state)
        same_bits(untied, state)
        assert tied["lm_head"] is tied_embed  # still one tensor under two names
    m = sub_tied.manifest(3)
    assert set(m.tensors()) == {"embed", "norm"} and m.aliases() == {"lm_head": "embed"}
    fresh = Subscriber(local_store).materialize()
    same_bits(fresh, state)
    assert np.shares_memory(fresh["embed"], fresh["lm_head"])  # restored as an alias


def test_a_restarted_publisher_continues_a_tied_stream(tmp_path, same_bits) -> None:
    store, state = LocalStore(tmp_path / "s"), _tied_state(1)
    Publisher(store, **SMALL).publish(0, state)
    engine = {k: np.zeros_like(v) for k, v in state.items()}
    engine["lm_head"] = engine["embed"]
    sub = Subscriber(store)
    sub.pull(engine)
    _step(state, 1)
    Publisher(store, **SMALL).publish(1, state)  # rebuilds its base from the store
    sub.pull(engine)
    same_bits(engine, state)


def test_equal_values_in_two_tensors_are_not_aliases(local_store) -> None:
    state = _tied_state()
    state["lm_head"] = state["embed"].copy()  # untied, same values
    Publisher(local_store, **SMALL).publish(0, state)
    m = Subscriber(local_store).manifest(0)
    assert set(m.tensors()) == {"embed", "lm_head", "norm"} and m.aliases() == {}


def test_a_tied_subscriber_of_an_untied_stream(local_store, same_bits) -> None:
    """Published as two tensors with equal contents (a file saved from a tied model and
    published again): a subscriber that ties them patches once and checks both."""
    state = _tied_state()
    state["lm_head"] = state["embed"].copy()
    pub = Publisher(local_store, **SMALL)
    pub.publish(0, state)
    engine = {k: np.zeros_like(v) for k, v in state.items()}
    engine["lm_head"] = engine["embed"]
    sub = Subscriber(local_store)
    sub.pull(engine)
    for name in ("embed", "lm_head"):
        state[name].view(np.uint16)[::41] += 1  # both changed the same way
    pub.publish(1, state)
    sub.pull(engine)
    same_bits(engine, state)
    state["lm_head"].view(np.uint16)[::43] += 1  # now they differ: the tie cannot hold
    pub.publish(2, state)
    with pytest.raises(DeltaSyncError, match=r"'embed' and 'lm_head'.*tied"):
        sub.pull(engine)


def test_partly_overlapping_tensors_are_refused_naming_both(local_store) -> None:
    state = _tied_state()
    state["head_rows"] = state["embed"][:10]  # shares memory, but is not the same tensor
    with pytest.raises(DeltaSyncError, match="'embed' and 'head_rows'") as e:
        Publisher(local_store, **SMALL).publish(0, state)
    assert "\n" not in str(e.value)


def test_tying_may_not_change_within_a_stream(local_store) -> None:
    state = _tied_state()
    pub = Publisher(local_store, **SMALL)
    pub.publish(0, state)
    state["lm_head"] = state["embed"].copy()
    with pytest.raises(DeltaSyncError, match=r"'embed' and 'lm_head'.*new store"):
        pub.publish(1, state)


def test_in_memory_encode_and_apply_with_tied_tensors(same_bits) -> None:
    base = _tied_state()
    snapshot = {k: v.copy() for k, v in base.items()}  # a copy unties: fine as a base
    new = _tied_state()
    _step(new, 3)
    blob = encode_delta(snapshot, new)
    tied = {k: v.copy() for k, v in base.items()}
    tied["lm_head"] = tied["embed"]
    apply_delta(tied, blob)
    same_bits(tied, new)
    untied = {k: v.copy() for k, v in base.items()}
    apply_delta(untied, blob)
    same_bits(untied, new)
    full = decode_full(encode_full(new))
    same_bits(full, new)
    assert np.shares_memory(full["embed"], full["lm_head"])


def test_torch_tied_weights_publish_pull_and_in_memory(local_store, same_bits) -> None:
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Embedding(300, 48), torch.nn.Linear(48, 300, bias=False))
    model = model.to(torch.bfloat16)
    model[1].weight = model[0].weight  # tie_word_embeddings
    pub = Publisher(local_store, **SMALL)
    engine = torch.nn.Sequential(torch.nn.Embedding(300, 48), torch.nn.Linear(48, 300, bias=False))
    engine = engine.to(torch.bfloat16)
    engine[1].weight = engine[0].weight
    sub = Subscriber(local_store)
    for v in range(3):
        with torch.no_grad():
            model[0].weight.view(torch.int16)[v::29] += 1
        state = model.state_dict()
        assert state["0.weight"].data_ptr() == state["1.weight"].data_ptr()
        pub.publish(v, state)
        sub.pull(engine.state_dict())
        same_bits(engine.state_dict(), model.state_dict())
    assert engine[0].weight.data_ptr() == engine[1].weight.data_ptr()
    # in memory: a delta between two torch snapshots, applied onto a tied module
    before = {k: t.clone() for k, t in model.state_dict().items()}
    with torch.no_grad():
        model[0].weight.view(torch.int16)[::31] += 1
    apply_delta(engine.state_dict(), encode_delta(before, model.state_dict()))
    same_bits(engine.state_dict(), model.state_dict())
    overlapping = {"0.weight": model[0].weight, "rows": model[0].weight[:5]}
    with pytest.raises(DeltaSyncError, match=r"'0\.weight' and 'rows'"):
        encode_full(overlapping)


def test_a_rank_with_tied_tensors_in_a_group(local_store, same_bits) -> None:
    state = _tied_state(2)
    parts = {"rank0": {"embed": state["embed"], "lm_head": state["lm_head"]}}
    parts["rank1"] = {"norm": state["norm"]}
    ranks = {p: Publisher(local_store, part=p, group=list(parts), **SMALL) for p in parts}
    tied = {k: np.zeros_like(v) for k, v in state.items()}
    tied["lm_head"] = tied["embed"]
    sub = Subscriber(local_store)
    with ThreadPoolExecutor(2) as pool:
        for v in range(2):
            if v:
                _step(state, v)
            futures = [pool.submit(ranks[p].publish, v, parts[p]) for p in parts]
            [f.result() for f in futures]
            sub.pull(tied)
            same_bits(tied, state)
    assert sub.manifest(1).aliases() == {"lm_head": "embed"}
    mine = Subscriber(local_store, parts=["rank0"]).materialize()
    assert set(mine) == {"embed", "lm_head"} and mine["lm_head"] is mine["embed"]
