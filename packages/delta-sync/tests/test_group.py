"""Per-rank publishing: each rank publishes the delta of its own tensors, the first rank
commits the version, subscribers reassemble the whole state."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tandem.delta_sync import DeltaSyncError, Publisher, StoreError, Subscriber
from tandem.delta_sync.cli import main
from tandem.delta_sync.manifest import part_key

SMALL = {"chunk_bytes": 1 << 16, "shard_bytes": 1 << 17}
GROUP = ["rank0", "rank1"]


def _split(state: dict) -> list[dict]:
    """Each rank owns every other tensor (as a sharded trainer owns its shard)."""
    names = sorted(state)
    return [{n: state[n] for n in names[r :: len(GROUP)]} for r in range(len(GROUP))]


def _ranks(store, **kwargs) -> list[Publisher]:
    return [Publisher(store, part=p, group=GROUP, **SMALL, **kwargs) for p in GROUP]


def _publish_all(pool, ranks: list[Publisher], version: int, state: dict) -> list:
    shards = _split(state)
    futures = [pool.submit(pub.publish, version, shards[r]) for r, pub in enumerate(ranks)]
    return [f.result() for f in futures]


def test_ranks_publish_their_own_tensors_and_engines_get_the_whole_state(
    local_store, trainer, same_bits, capsys
) -> None:
    ranks = _ranks(local_store, anchor_every=3)
    engine = {k: np.zeros_like(v) for k, v in trainer.snapshot().items()}
    sub = Subscriber(local_store)
    history = {}
    with ThreadPoolExecutor(len(ranks)) as pool:
        for v in range(7):
            history[v] = trainer.step()
            reports = _publish_all(pool, ranks, v, history[v])
            assert [r.is_anchor for r in reports] == [v % 3 == 0] * len(ranks)
            assert sub.pull(engine).version == v
            same_bits(engine, history[v])
    m = sub.manifest(6)
    assert [p.name for p in m.parts] == GROUP
    own = [set(s) for s in _split(history[6])]
    assert [{t.name for t in p.tensors} for p in m.parts] == own
    # no rank ever held the other's tensors (no gather of the full model)
    assert [set(pub._prev) for pub in ranks] == own
    # a reader from nothing takes the anchor plus catch-up deltas of every part
    fresh = Subscriber(local_store, version=None)
    assert fresh.prepare().path == [(6, None)]
    same_bits(Subscriber(local_store).materialize(5), history[5])
    # a rank (or anything) can pull its own part only
    mine = Subscriber(local_store, parts=["rank1"]).materialize()
    assert set(mine) == own[1]
    same_bits(mine, _split(history[6])[1])
    with pytest.raises(DeltaSyncError, match="has no part 'rank9'"):
        Subscriber(local_store, parts=["rank9"]).prepare()
    capsys.readouterr()
    assert main(["inspect", str(local_store.root)]) == 0
    table = capsys.readouterr().out
    assert "rank0" in table and "rank1" in table


def test_a_restarted_rank_rebuilds_only_its_part_and_continues(
    local_store, trainer, same_bits
) -> None:
    ranks = _ranks(local_store)
    with ThreadPoolExecutor(len(ranks)) as pool:
        for v in range(3):
            _publish_all(pool, ranks, v, trainer.step())
        ranks[1] = Publisher(local_store, part="rank1", group=GROUP, **SMALL)  # restarted
        state = trainer.step()
        reports = _publish_all(pool, ranks, 3, state)
    assert set(ranks[1]._prev) == set(_split(state)[1])
    assert not reports[1].is_anchor  # it continued the stream with a delta
    same_bits(Subscriber(local_store).materialize(), state)


def test_a_missing_rank_times_out_with_its_name_and_commits_nothing(
    local_store, trainer, same_bits
) -> None:
    ranks = _ranks(local_store, commit_timeout=0.3)
    with ThreadPoolExecutor(len(ranks)) as pool:
        _publish_all(pool, ranks, 0, v0 := trainer.step())
        v1 = trainer.step()
        with pytest.raises(StoreError, match=r"version 1: part 'rank1' .* nothing was committed"):
            ranks[0].publish(1, _split(v1)[0])  # rank1 died before publishing version 1
        assert Subscriber(local_store).latest() == 0
        same_bits(Subscriber(local_store).materialize(), v0)
        assert local_store.exists(part_key(1, "rank0"))
        # the job restarts: every rank publishes version 1 again, and it commits
        _publish_all(pool, ranks, 1, v1)
    same_bits(Subscriber(local_store).materialize(), v1)


def test_group_settings_are_checked(local_store, trainer) -> None:
    with pytest.raises(DeltaSyncError, match="not in its group"):
        Publisher(local_store, part="rank2", group=GROUP)
    with pytest.raises(DeltaSyncError, match="twice"):
        Publisher(local_store, part="rank0", group=["rank0", "rank0"])
    ranks = _ranks(local_store, commit_timeout=0.5)
    state = _split(trainer.step())
    state[1][sorted(state[0])[0]] = state[0][sorted(state[0])[0]]  # a tensor in both parts
    with ThreadPoolExecutor(len(ranks)) as pool:
        futures = [pool.submit(pub.publish, 0, state[r]) for r, pub in enumerate(ranks)]
        with pytest.raises(DeltaSyncError, match="each tensor belongs to one rank"):
            futures[0].result()
        with pytest.raises(StoreError, match=r"the manifest .* did not appear"):
            futures[1].result()  # the other rank gives up waiting for the commit
    assert Subscriber(local_store).latest() is None
