"""Weight flow from the trainer to the engines through delta-sync.

The trainer publishes every policy version into a store (a local directory by default, any
delta-sync store URL by config); engines follow the same store with a `Subscriber` and pull
in two phases. A resumed run starts a new *stream* (a fresh prefix with a full anchor):
versions published after the last checkpoint by the killed process are never re-used, so
a resumed trainer can publish the same version numbers again without colliding.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog
import torch

from tandem.delta_sync import (
    Publisher,
    PublishReport,
    StoreError,
    Subscriber,
    open_store,
)
from tandem.orchestrator.training.sharding import is_sharded, local_shards

log = structlog.get_logger()


def stream_url(base: str, run_dir: Path, stream: int) -> str:
    """Where stream ``stream`` lives: ``<base>/stream-N``, or an absolute directory under the
    run dir when there is no base (created here), so other processes can open it too."""
    if not base:
        path = (run_dir / "weights" / f"stream-{stream:04d}").resolve()
        path.mkdir(parents=True, exist_ok=True)
        return str(path)
    return f"{base.rstrip('/')}/stream-{stream:04d}"


def stream_store(base: str, run_dir: Path, stream: int) -> Any:
    """The store of stream ``stream`` (see `stream_url`)."""
    return open_store(stream_url(base, run_dir, stream))


def state_for_sync(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors that define a policy version (names as in the model's state dict)."""
    return {k: v.detach() for k, v in model.state_dict().items()}


def rank_partition(sizes: Mapping[str, int], world: int) -> list[list[str]]:
    """Tensor names split over `world` trainer ranks with about equal bytes each.

    Deterministic (largest first, ties by name, each to the least-loaded rank), so every rank
    computes the same split without talking to the others.
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    ranks: list[list[str]] = [[] for _ in range(world)]
    load = [0] * world
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        r = min(range(world), key=lambda i: (load[i], i))
        ranks[r].append(name)
        load[r] += sizes[name]
    return [sorted(names) for names in ranks]


class WeightPublisher:
    """Publishes policy versions of the trainer's model and remembers the figures (the
    `WeightSink` of the local backend and of each Ray trainer rank).

    With ``world`` > 1 (a data-parallel trainer of that many processes), rank ``rank``
    publishes only its part of the version, and rank 0 commits it: its `rank_partition` of
    the tensors when every rank holds the whole model (DDP), its own shards of every tensor
    under FSDP (`local_shards`). No process gathers or sends the whole model, and
    subscribers reassemble it.

    `try_publish` survives a failing store: the version is left `pending` (the stream is
    intact: delta-sync commits nothing partial, and its publisher rebuilds its base from the
    store on the next attempt), and the caller retries later, with a newer version if the
    trainer has moved on. Engines keep serving the weights they have meanwhile.
    """

    def __init__(
        self,
        store: Any,
        model: torch.nn.Module,
        *,
        anchor_every: int,
        rank: int = 0,
        world: int = 1,
    ) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in [0, {world})")
        self.store = store
        self.model = model
        self.rank, self.world = rank, world
        group = None if world == 1 else [f"rank{i}" for i in range(world)]
        part = "main" if group is None else group[rank]
        self.publisher = Publisher(store, anchor_every=anchor_every, part=part, group=group)
        self.names: set[str] | None = None  # this rank's tensors (all when world == 1)
        self.reports: list[PublishReport] = []
        self.pending: int | None = None  # a version whose publish failed, not yet retried
        self.failures = 0

    def publish(self, version: int) -> PublishReport:
        """Publish the model's weights now as ``version`` (raises `StoreError` if the store
        fails)."""
        state = state_for_sync(self.model)
        if self.world > 1 and any(is_sharded(v) for v in state.values()):
            state = local_shards(state, self.rank, self.world)  # FSDP: this rank's shards
        elif self.world > 1:
            if self.names is None:
                sizes = {k: v.numel() * v.element_size() for k, v in state.items()}
                self.names = set(rank_partition(sizes, self.world)[self.rank])
            state = {k: v for k, v in state.items() if k in self.names}
        report = self.publisher.publish(version, state)
        self.reports.append(report)
        self.pending = None
        return report

    def try_publish(self, version: int) -> PublishReport | None:
        """`publish`, or None when the store fails (then `pending` is set)."""
        try:
            return self.publish(version)
        except StoreError as e:
            self.failures += 1
            self.pending = version
            log.warning("rl.publish_failed", version=version, failures=self.failures, error=str(e))
            return None

    def close(self) -> None:
        """Stop the delta-sync publisher's threads (started again on the next publish)."""
        self.publisher.close()

    def subscriber(self, version: int | None) -> Subscriber:
        return Subscriber(self.store, version=version)


def weights_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bit-for-bit equality of two states (compares bit patterns, so NaNs and -0.0 count)."""
    if a.keys() != b.keys():
        return False
    for name, x in a.items():
        y = b[name]
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
        if not torch.equal(x.contiguous().view(bits), y.contiguous().view(bits)):
            return False
    return True
