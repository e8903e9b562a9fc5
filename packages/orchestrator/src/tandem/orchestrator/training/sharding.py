"""The FSDP layout of the policy: sharding the model, naming the shards, reassembling them.

With ``trainer.parallel = "fsdp"`` each trainer rank applies torch's `fully_shard` to every
decoder layer and to the root, so it holds only its dim-0 shard (``torch.chunk`` over the
ranks) of each parameter, gradient and optimizer moment. A rank publishes exactly those
shards through delta-sync, under `shard_name`s; an engine applies them into row views of
its whole tensors (`ShardViews`), so the subscriber reassembles the model without any
process ever gathering it. Checkpoints take every rank's shards and concatenate them
(`merge_shards`), which is also the layout the ``local`` backend saves, so a run can resume
on either backend. The shards' names and the views engines apply them into are in
`tandem.orchestrator.shards`, which the inference side shares.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tandem.orchestrator.shards import dim0_shard, shard_name


def is_sharded(t: Any) -> bool:
    """Whether ``t`` is a DTensor (an FSDP parameter, gradient or optimizer moment)."""
    return hasattr(t, "to_local") and hasattr(t, "device_mesh")


def shard_model(model: torch.nn.Module, device: torch.device) -> None:
    """Shard ``model`` in place over the default process group (which must exist): every
    decoder layer is one FSDP unit (gathered for its forward and backward only), the
    embedding, final norm and head the root's."""
    from torch.distributed.fsdp import fully_shard

    model.to(device)
    for layer in getattr(model, "layers", []):
        fully_shard(layer)
    fully_shard(model)


def local_shards(state: Mapping[str, torch.Tensor], rank: int, world: int) -> dict[str, Any]:
    """What rank ``rank`` publishes of a sharded state: its shard of each DTensor under its
    `shard_name`; plain tensors (buffers, replicated on every rank) whole, from rank 0."""
    out: dict[str, Any] = {}
    for name, t in state.items():
        if is_sharded(t):
            local = t.to_local()
            if local.numel():
                out[shard_name(name, rank, world)] = local.detach()
        elif rank == 0:
            out[name] = t.detach()
    return out


def merge_shards(parts: Sequence[Mapping[str, Any]], sharded: set[str]) -> dict[str, Any]:
    """Whole tensors from every rank's local pieces (rank order): names in ``sharded`` are
    concatenated along dim 0, the others (replicated) taken from rank 0."""
    return {
        name: torch.cat([p[name] for p in parts], dim=0) if name in sharded else value
        for name, value in parts[0].items()
    }


def local_state(state: Mapping[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """A rank's pieces of a (possibly sharded) state as plain tensors, and which were shards."""
    pieces = {k: (v.to_local() if is_sharded(v) else v).detach().clone() for k, v in state.items()}
    return pieces, {k for k, v in state.items() if is_sharded(v)}


def local_optimizer_state(
    state: dict[str, Any],
) -> tuple[dict[str, Any], set[tuple[int, str]]]:
    """A rank's optimizer state dict with its moments as plain local shards, and which
    (parameter index, key) entries were sharded."""
    moments: dict[int, dict[str, Any]] = {}
    sharded: set[tuple[int, str]] = set()
    for index, entry in state["state"].items():
        moments[index] = {}
        for key, value in entry.items():
            if is_sharded(value):
                sharded.add((index, key))
                value = value.to_local().detach().clone()
            moments[index][key] = value
    return {"state": moments, "param_groups": state["param_groups"]}, sharded


def merge_optimizer_states(
    parts: Sequence[dict[str, Any]], sharded: set[tuple[int, str]]
) -> dict[str, Any]:
    """One whole optimizer state dict (the layout of an unsharded AdamW) from every rank's
    `local_optimizer_state` (rank order)."""
    first = parts[0]
    state = {
        index: {
            key: torch.cat([p["state"][index][key] for p in parts], dim=0)
            if (index, key) in sharded
            else value
            for key, value in entry.items()
        }
        for index, entry in first["state"].items()
    }
    return {"state": state, "param_groups": first["param_groups"]}


def shard_optimizer_state(
    state: dict[str, Any], params: Sequence[torch.nn.Parameter], rank: int, world: int
) -> dict[str, Any]:
    """A whole optimizer state dict cut to this rank's shards of ``params`` (DTensors), so
    an FSDP rank resumes from a checkpoint of any backend."""
    from torch.distributed.tensor import DTensor

    out: dict[int, dict[str, Any]] = {}
    for index, entry in state["state"].items():
        p = params[int(index)]
        out[index] = {}
        for key, value in entry.items():
            if is_sharded(p) and torch.is_tensor(value) and value.shape == p.shape:
                local = dim0_shard(value, rank, world).to(p.to_local().device, copy=True)
                value = DTensor.from_local(
                    local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                )
            out[index][key] = value
    return {"state": out, "param_groups": state["param_groups"]}
