"""The names of an FSDP trainer's published shards, and the views an engine applies them into.

A rank of a trainer sharded along dim 0 publishes its rows of each tensor under
`shard_name` (``name@shardRofW``). An engine holding the whole tensors applies every
rank's part in place through `ShardViews`: row views that write through, so the model is
reassembled without any process gathering it. The trainer's side (sharding the model,
joining checkpoints) is `tandem.orchestrator.training.sharding`; both follow this naming.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

import torch

_SHARD = re.compile(r"^(?P<name>.+)@shard(?P<rank>\d+)of(?P<world>\d+)$")


def shard_name(name: str, rank: int, world: int) -> str:
    """The published name of rank ``rank``'s dim-0 shard of tensor ``name``."""
    return f"{name}@shard{rank}of{world}"


def dim0_shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rows of ``t`` that rank ``rank`` of ``world`` holds under `fully_shard` (a view;
    empty when ``t`` has fewer chunks than ranks)."""
    chunks = torch.chunk(t, world, dim=0)
    return chunks[rank] if rank < len(chunks) else t[:0]


class ShardViews(Mapping[str, torch.Tensor]):
    """A state's tensors by name, plus their dim-0 shards by `shard_name` (row views that
    write through), so one subscriber applies a sharded trainer's parts in place."""

    def __init__(self, state: Mapping[str, torch.Tensor]) -> None:
        self.state = state

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self.state:
            return self.state[key]
        match = _SHARD.match(key)
        if match is None or match["name"] not in self.state:
            raise KeyError(key)
        rank, world = int(match["rank"]), int(match["world"])
        if not 0 <= rank < world:
            raise KeyError(key)
        return dim0_shard(self.state[match["name"]], rank, world)

    def __contains__(self, key: object) -> bool:
        try:
            self[key]  # type: ignore[index]
        except KeyError:
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(self.state)

    def __len__(self) -> int:
        return len(self.state)
