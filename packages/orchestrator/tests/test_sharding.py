"""The FSDP layout helpers: shard names, row views that write through, and joining every
rank's pieces back into whole tensors (checked against slicing and concatenating by hand)."""

from __future__ import annotations

import pytest
import torch

from tandem.orchestrator.shards import ShardViews, dim0_shard, shard_name
from tandem.orchestrator.training.sharding import (
    local_shards,
    merge_optimizer_states,
    merge_shards,
)


@pytest.mark.parametrize(("rows", "world"), [(5, 2), (6, 3), (1, 2), (7, 4)])
def test_dim0_shards_tile_the_rows_as_fully_shard_splits_them(rows: int, world: int) -> None:
    t = torch.arange(rows * 3, dtype=torch.float32).view(rows, 3)
    pieces = [dim0_shard(t, r, world) for r in range(world)]
    assert torch.equal(torch.cat(pieces), t)
    # torch.chunk's sizes: ceil(rows / world) per rank, the rest on the last ones, then empty
    size = -(-rows // world)
    assert [p.shape[0] for p in pieces] == [
        max(0, min(size, rows - r * size)) for r in range(world)
    ]


def test_shard_views_write_through_to_the_whole_tensor() -> None:
    state = {"w": torch.zeros(5, 2), "b": torch.zeros(3)}
    views = ShardViews(state)
    views[shard_name("w", 1, 2)].fill_(7.0)  # rows 3 and 4
    assert state["w"][3:].eq(7).all() and state["w"][:3].eq(0).all()
    assert shard_name("w", 0, 2) in views and "b" in views
    assert shard_name("w", 2, 2) not in views  # no such rank
    assert shard_name("nope", 0, 2) not in views and "w@shard0of" not in views
    with pytest.raises(KeyError):
        views[shard_name("nope", 0, 2)]
    assert sorted(views) == ["b", "w"] and len(views) == 2


def test_plain_tensors_are_published_whole_by_rank_zero_only() -> None:
    state = {"buffer": torch.ones(3)}
    assert set(local_shards(state, 0, 2)) == {"buffer"}
    assert local_shards(state, 1, 2) == {}


def test_merging_rank_pieces_gives_the_whole_state_and_optimizer() -> None:
    gen = torch.Generator().manual_seed(0)
    whole = {"w": torch.randn(5, 4, generator=gen), "b": torch.randn(2, generator=gen)}
    parts = [{"w": dim0_shard(whole["w"], r, 2), "b": whole["b"]} for r in range(2)]
    merged = merge_shards(parts, {"w"})
    assert torch.equal(merged["w"], whole["w"]) and merged["b"] is whole["b"]

    moments = torch.randn(5, 4, generator=gen)
    optim = [
        {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": dim0_shard(moments, r, 2)}},
            "param_groups": [{"lr": 0.1, "params": [0]}],
        }
        for r in range(2)
    ]
    joined = merge_optimizer_states(optim, {(0, "exp_avg")})
    assert torch.equal(joined["state"][0]["exp_avg"], moments)
    assert float(joined["state"][0]["step"]) == 3.0
    assert joined["param_groups"] == [{"lr": 0.1, "params": [0]}]
