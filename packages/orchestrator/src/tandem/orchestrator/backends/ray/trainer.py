"""The trainer of the ``ray`` backend: ``trainer.processes`` data-parallel ranks as Ray actors.

Each `TrainerRank` holds the whole model (``trainer.parallel = "ddp"``: DDP through
accelerate, gloo on CPU, NCCL where there are GPUs) or its dim-0 shard of every parameter
(``"fsdp"``: torch's `fully_shard` over the group accelerate joins), trains on its
`shard_by_group` share of every step's groups and publishes only its own part through
delta-sync (a partition of the tensors, or its shards; rank 0 commits the version), so no
process ever gathers or sends the whole model to publish. Checkpoints collect every rank's
pieces on the driver. The driver talks to the ranks through `RayTrainer` (the backend's
`Trainer`) and `RaySink` (its `WeightSink`); groups travel to them as wire messages.

Every rank sees the same groups (small: token ids and routes), so a step depends only on
them and the weights: with ``processes`` = 2 the update is the one a single process makes
with ``trainer.processes = 2`` on the local backend (`GRPOStep.step`'s ``shards``), bit
for bit at the same per-process thread count.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog
import torch

from tandem.delta_sync import PayloadReport, PublishReport
from tandem.moe_determinism import MoEConfig, MoETransformer
from tandem.orchestrator.config import RayConfig, TrainerConfig
from tandem.orchestrator.training.sharding import (
    local_optimizer_state,
    local_state,
    merge_optimizer_states,
    merge_shards,
    shard_optimizer_state,
)
from tandem.orchestrator.wire import Sample, decode, encode

log = structlog.get_logger()


class TrainerSpec(msgspec.Struct, kw_only=True):
    """What every rank needs to build its trainer and publisher."""

    model: MoEConfig
    trainer: TrainerConfig
    deterministic: bool
    temperature: float
    vocab: int | None = None  # the tokenizer's ids (rows past them are never scored)
    store_url: str
    anchor_every: int
    torch_threads: int
    nice: int = -1  # every rank's nice value (-1: as Ray starts it)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class TrainerRank:
    """One data-parallel trainer process (the body of a Ray actor)."""

    def __init__(self, spec: TrainerSpec, rank: int, world: int) -> None:
        self.spec, self.rank, self.world = spec, rank, world

    def master_address(self) -> tuple[str, int]:
        """Where the gloo group meets (asked of rank 0)."""
        import ray

        return ray.util.get_node_ip_address(), _free_port()

    def setup(
        self,
        master: tuple[str, int],
        state: dict[str, torch.Tensor],
        optimizer_state: dict[str, Any] | None,
        reference: dict[str, torch.Tensor] | None = None,
    ) -> None:
        from tandem.delta_sync import open_store
        from tandem.orchestrator.runtime.allocator import reuse_freed_memory
        from tandem.orchestrator.runtime.priority import set_nice
        from tandem.orchestrator.training.trainer import RLTrainer
        from tandem.orchestrator.training.weights import WeightPublisher

        spec = self.spec
        reuse_freed_memory()
        if spec.torch_threads:
            torch.set_num_threads(spec.torch_threads)
        if spec.nice >= 0:
            set_nice(spec.nice)
        if self.world > 1:  # what `accelerate launch` would set; accelerate joins the group
            os.environ.update(
                MASTER_ADDR=master[0],
                MASTER_PORT=str(master[1]),
                RANK=str(self.rank),
                LOCAL_RANK=str(self.rank),
                WORLD_SIZE=str(self.world),
                LOCAL_WORLD_SIZE=str(self.world),
            )
            if not torch.cuda.is_available():
                os.environ["ACCELERATE_USE_CPU"] = "true"
        model = MoETransformer(spec.model)
        model.load_state_dict(state)
        self.trainer = RLTrainer(
            model,
            spec.trainer,
            deterministic=spec.deterministic,
            temperature=spec.temperature,
            vocab=spec.vocab,
            rank=self.rank,
            world=self.world,
            reference=reference,
        )
        if optimizer_state is not None:
            if self.trainer.fsdp and self.world > 1:
                params = list(self.trainer.model.parameters())
                optimizer_state = shard_optimizer_state(
                    optimizer_state, params, self.rank, self.world
                )
            self.trainer.grpo.optimizer.load_state_dict(optimizer_state)
        self.publisher = WeightPublisher(
            open_store(spec.store_url),
            self.trainer.model,
            anchor_every=spec.anchor_every,
            rank=self.rank,
            world=self.world,
        )

    def step(self, groups: bytes, version: int) -> dict[str, Any]:
        return self.trainer.step(decode(groups, list[list[Sample]]), version)

    def publish(self, version: int) -> PublishReport | None:
        return self.publisher.try_publish(version)

    def snapshot(self) -> RankSnapshot:
        """This rank's weights and optimizer state (its shards under FSDP, else whole) for a
        checkpoint or the final policy."""
        state, sharded = local_state(self.trainer.model.state_dict())
        optimizer, sharded_moments = local_optimizer_state(self.trainer.grpo.optimizer.state_dict())
        return RankSnapshot(state, sharded, optimizer, sharded_moments)


@dataclass
class RankSnapshot:
    """One rank's pieces of the trainer state; ``sharded*`` name the pieces that are dim-0
    shards (concatenated over ranks by `merge_snapshots`)."""

    state: dict[str, torch.Tensor]
    sharded: set[str]
    optimizer: dict[str, Any]
    sharded_moments: set[tuple[int, str]]


def merge_snapshots(parts: list[RankSnapshot]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(whole weights, whole optimizer state) from every rank's snapshot."""
    first = parts[0]
    if not first.sharded:  # DDP: every rank holds it all
        return first.state, first.optimizer
    state = merge_shards([p.state for p in parts], first.sharded)
    optimizer = merge_optimizer_states([p.optimizer for p in parts], first.sharded_moments)
    return state, optimizer


def _gather(refs: list[Any]) -> list[Any]:
    """The results of calls made on every rank; a rank's error is raised as soon as it is
    there (its peers may be waiting for it in a collective that never completes)."""
    import ray

    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        ray.get(ready[0])
    return ray.get(refs)


def merge_reports(reports: list[PublishReport]) -> PublishReport:
    """One version published in parts, as one report: bytes and counts summed per payload
    (kind, base), the slowest part's time."""
    first = reports[0]
    payloads: list[PayloadReport] = []
    for i, p in enumerate(first.payloads):
        same = [r.payloads[i] for r in reports if i < len(r.payloads)]
        chunks: dict[str, int] = {}
        for q in same:
            for k, v in q.chunks.items():
                chunks[k] = chunks.get(k, 0) + v
        payloads.append(
            msgspec.structs.replace(
                p,
                nbytes=sum(q.nbytes for q in same),
                changed=sum(q.changed for q in same),
                chunks=chunks,
                shards=sum(q.shards for q in same),
                uploaded=sum(q.uploaded for q in same),
                skipped=sum(q.skipped for q in same),
            )
        )
    return msgspec.structs.replace(
        first,
        dense_bytes=sum(r.dense_bytes for r in reports),
        numel=sum(r.numel for r in reports),
        payloads=payloads,
        seconds=max(r.seconds for r in reports),
    )


class RayTrainer:
    """The driver's handle on the trainer ranks (`Trainer`)."""

    def __init__(
        self,
        spec: TrainerSpec,
        config: RayConfig,
        *,
        state: dict[str, torch.Tensor],
        optimizer_state: dict[str, Any] | None,
        run_name: str,
        reference: dict[str, torch.Tensor] | None = None,
        while_starting: Callable[[], None] | None = None,
    ) -> None:
        """``reference``: the KL penalty's reference weights (the driver's, which a resumed
        run's ranks could not rebuild from the checkpointed weights they start from).
        ``while_starting``: called once the ranks are asked for, before waiting for them
        (other actors asked for then start beside them, and the ranks keep their place in
        a cluster that cannot yet hold everything)."""
        import ray

        self.world = spec.trainer.processes
        self.sharded = spec.trainer.parallel == "fsdp" and self.world > 1
        cls = ray.remote(TrainerRank)
        self.ranks = [
            cls.options(
                num_cpus=config.trainer_cpus,
                num_gpus=config.trainer_gpus,
                name=f"{run_name}-trainer-{rank}",
            ).remote(spec, rank, self.world)
            for rank in range(self.world)
        ]
        if while_starting is not None:
            while_starting()
        master = ray.get(self.ranks[0].master_address.remote())
        state_ref = ray.put(state)
        ref = ray.put(reference) if reference is not None else None
        _gather([r.setup.remote(master, state_ref, optimizer_state, ref) for r in self.ranks])
        log.info("ray.trainer_ready", processes=self.world)

    def step(self, groups: Sequence[Sequence[Sample]], version: int) -> dict[str, Any]:
        message = encode([list(g) for g in groups])
        results = _gather([r.step.remote(message, version) for r in self.ranks])
        return results[0]

    def weights(self) -> dict[str, torch.Tensor]:
        return self.checkpoint_state()[0]

    def checkpoint_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Whole weights and optimizer state: rank 0's under DDP, every rank's shards
        joined under FSDP."""
        ranks = self.ranks if self.sharded else self.ranks[:1]
        return merge_snapshots(_gather([r.snapshot.remote() for r in ranks]))

    def close(self) -> None:
        import ray

        for r in self.ranks:
            ray.kill(r, no_restart=True)


class RaySink:
    """The ranks' publishes as one `WeightSink`: every rank publishes its part of a version
    (rank 0 commits), and the parts' reports are merged."""

    def __init__(self, trainer: RayTrainer) -> None:
        self.ranks = trainer.ranks
        self.reports: list[PublishReport] = []
        self.pending: int | None = None
        self.failures = 0

    def try_publish(self, version: int) -> PublishReport | None:
        reports = _gather([r.publish.remote(version) for r in self.ranks])
        if any(r is None for r in reports):
            self.failures += 1
            self.pending = version
            return None
        self.pending = None
        merged = merge_reports(reports)
        self.reports.append(merged)
        return merged

    def publish(self, version: int) -> PublishReport:
        report = self.try_publish(version)
        if report is None:
            raise RuntimeError(f"publishing version {version} failed: the weight store failed")
        return report

    def close(self) -> None:
        return None  # the ranks' publishers go with the ranks
