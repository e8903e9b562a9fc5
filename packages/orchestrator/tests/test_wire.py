"""Wire messages survive the trip between processes bit for bit (msgpack with numpy arrays)."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.orchestrator.wire import PlayedGroup, RolloutStats, Sample, decode, encode


def _sample(i: int) -> Sample:
    rng = np.random.default_rng(i)
    n = 12
    return Sample(
        task_id=f"task-{i}",
        tokens=rng.integers(0, 266, n).tolist(),
        loss_mask=[0] * 4 + [1] * (n - 4),
        logprobs=[0.0] * 4 + (-rng.random(n - 4)).astype(np.float32).tolist(),
        versions=[-1] * 4 + [3] * (n - 4),
        routes=rng.integers(0, 8, (n - 1, 2, 2)).astype(np.uint8),
        reward=float(i % 2),
        resolved=bool(i % 2),
        turns=2,
        termination="submit",
        min_version=3,
        max_version=3,
        messages=[{"role": "user", "content": "ü <|end|>"}],
    )


def test_a_played_group_round_trips_exactly() -> None:
    played = PlayedGroup(index=7, samples=[_sample(i) for i in range(3)])
    back = decode(encode(played), PlayedGroup)
    assert back.index == 7 and back.dropped == "" and len(back.samples) == 3
    for a, b in zip(played.samples, back.samples, strict=True):
        for field in Sample.__struct_fields__:
            x, y = getattr(a, field), getattr(b, field)
            if isinstance(x, np.ndarray):
                assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y)
                assert y.flags.writeable  # a copy, not a view of the message buffer
            else:
                assert x == y, field


def test_nested_lists_and_wide_routes() -> None:
    groups = [[_sample(1)], [_sample(2), _sample(3)]]
    groups[1][0].routes = groups[1][0].routes.astype(np.int32) + 300  # > 255 experts
    back = decode(encode(groups), list[list[Sample]])
    assert [len(g) for g in back] == [1, 2]
    assert back[1][0].routes.dtype == np.int32 and int(back[1][0].routes.min()) >= 300


def test_stats_merge_and_unknown_objects_are_refused() -> None:
    merged = RolloutStats.merge([RolloutStats(tokens_sampled=3, engine_version=5),
                                 RolloutStats(tokens_sampled=4, engine_version=2)])  # fmt: skip
    assert merged.tokens_sampled == 7 and merged.engine_version == 2 and merged.workers == 2
    assert decode(encode(merged), RolloutStats) == merged
    with pytest.raises(TypeError, match="cannot send an object of type object"):
        encode({"x": object()})
