"""Router replay: record each token's experts in one forward pass, force them in another.

Modes (arXiv 2510.11370; Qwen, arXiv 2512.01374):

* R3: the trace comes from the inference engine that generated the tokens. The trainer
  uses exactly the experts the rollout used; best when data is off-policy.
* R2: the trace comes from the trainer's own old-policy forward pass (e.g. the no-grad
  pass that computes old log-probs); enough when data is nearly on-policy.

Only expert *ids* are replayed: gate weights are recomputed from the current router
scores at those ids, so the router keeps receiving gradients.

Consumption rules: a `RouterReplay` hands each MoE layer its ids exactly once per forward
pass; a second request for the same layer, a trace whose token count, layer count or top-k
does not match the batch, or a replay object used for a second forward, raise
`MoEDeterminismError`. Under activation checkpointing the model takes a layer's ids
*before* entering the checkpointed block and passes them in as an input, so the recompute
in backward sees the same tensor and consumes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec
import numpy as np
import torch

from tandem.moe_determinism.errors import MoEDeterminismError

ReplayMode = Literal["R2", "R3"]


class RoutingTrace(msgspec.Struct, frozen=True):
    """Expert ids [tokens, layers, top_k] of one sequence (or a span of it), compact.

    Stored as raw bytes of the smallest unsigned integer type that holds `num_experts`
    (uint8 up to 256 experts, uint16 up to 65536), so a 50k-token trace of 48 layers x top-8
    is ~19 MB at uint8. Encodes with msgspec (msgpack or JSON) as-is.
    """

    tokens: int
    layers: int
    top_k: int
    num_experts: int
    data: bytes

    @staticmethod
    def dtype_for(num_experts: int) -> np.dtype:
        if num_experts <= 256:
            return np.dtype(np.uint8)
        if num_experts <= 65536:
            return np.dtype(np.uint16)
        return np.dtype(np.uint32)

    @classmethod
    def from_ids(cls, ids: np.ndarray | torch.Tensor, num_experts: int) -> RoutingTrace:
        """Build from an integer array [tokens, layers, top_k]."""
        if isinstance(ids, torch.Tensor):
            ids = ids.detach().cpu().numpy()
        ids = np.asarray(ids)
        if ids.ndim != 3:
            raise MoEDeterminismError(
                f"routing ids must be [tokens, layers, top_k], got shape {ids.shape}"
            )
        if ids.size and (ids.min() < 0 or ids.max() >= num_experts):
            raise MoEDeterminismError(f"routing ids must be in [0, {num_experts})")
        packed = np.ascontiguousarray(ids.astype(cls.dtype_for(num_experts)))
        t, layer_count, k = ids.shape
        return cls(
            tokens=t, layers=layer_count, top_k=k, num_experts=num_experts, data=packed.tobytes()
        )

    @property
    def expert_ids(self) -> np.ndarray:
        """Read-only view [tokens, layers, top_k] (no copy)."""
        arr = np.frombuffer(self.data, dtype=self.dtype_for(self.num_experts))
        return arr.reshape(self.tokens, self.layers, self.top_k)

    def __len__(self) -> int:
        return self.tokens

    def slice(self, start: int, stop: int) -> RoutingTrace:
        """Tokens [start, stop) of this trace."""
        return RoutingTrace.from_ids(self.expert_ids[start:stop], self.num_experts)

    @staticmethod
    def concat(traces: Sequence[RoutingTrace]) -> RoutingTrace:
        """Join spans of one sequence in order (e.g. prefill then each decoded token)."""
        if not traces:
            raise MoEDeterminismError("cannot concatenate an empty list of routing traces")
        first = traces[0]
        for t in traces[1:]:
            if (t.layers, t.top_k, t.num_experts) != (first.layers, first.top_k, first.num_experts):
                raise MoEDeterminismError(
                    "routing traces to concatenate must share layers, top_k and num_experts; "
                    f"got {(first.layers, first.top_k, first.num_experts)} and "
                    f"{(t.layers, t.top_k, t.num_experts)}"
                )
        ids = np.concatenate([t.expert_ids for t in traces], axis=0)
        return RoutingTrace.from_ids(ids, first.num_experts)

    def to_msgpack(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def from_msgpack(cls, blob: bytes) -> RoutingTrace:
        return msgspec.msgpack.decode(blob, type=cls)


class RouterReplay:
    """Replays per-sequence traces into one forward pass over a (padded or packed) batch.

    `traces[i]` covers the tokens of sequence i that this forward pass processes, in order.
    The model flattens the batch's valid tokens sequence by sequence, so row r of the
    concatenated trace belongs to the r-th valid token.
    """

    def __init__(self, traces: Sequence[RoutingTrace], mode: ReplayMode = "R3") -> None:
        if mode not in ("R2", "R3"):
            raise MoEDeterminismError(f"replay mode must be 'R2' or 'R3', got {mode!r}")
        if not traces:
            raise MoEDeterminismError("RouterReplay needs one trace per sequence in the batch")
        self.mode: ReplayMode = mode
        self.traces = list(traces)
        self._ids: torch.Tensor | None = None
        self._taken: set[int] = set()
        self._bound = False

    def bind(self, token_counts: Sequence[int], layers: int, top_k: int, num_experts: int) -> None:
        """Check the traces against the batch; called once by the model at forward start."""
        if self._bound:
            raise MoEDeterminismError(
                "this RouterReplay was already used for a forward pass; every recorded route "
                "is consumed exactly once — build a new RouterReplay for each forward"
            )
        if len(token_counts) != len(self.traces):
            raise MoEDeterminismError(
                f"batch has {len(token_counts)} sequences but {len(self.traces)} traces were given"
            )
        for i, (n, t) in enumerate(zip(token_counts, self.traces, strict=True)):
            if (t.tokens, t.layers, t.top_k) != (n, layers, top_k):
                raise MoEDeterminismError(
                    f"trace {i} is [tokens={t.tokens}, layers={t.layers}, top_k={t.top_k}] but "
                    f"the batch needs [{n}, {layers}, {top_k}]; pass the trace of exactly the "
                    "tokens this forward processes"
                )
            if t.num_experts != num_experts:
                raise MoEDeterminismError(
                    f"trace {i} was recorded with {t.num_experts} experts, model has {num_experts}"
                )
        ids = np.concatenate([t.expert_ids for t in self.traces], axis=0)
        self._ids = torch.from_numpy(ids.astype(np.int64))
        self._layers = layers
        self._bound = True

    def take(self, layer: int) -> torch.Tensor:
        """The ids [tokens, top_k] for `layer`; raises if this layer already took its ids."""
        if self._ids is None:
            raise MoEDeterminismError("RouterReplay.take called before bind()")
        if layer in self._taken:
            raise MoEDeterminismError(
                f"routes of layer {layer} were already consumed in this forward pass; under "
                "activation checkpointing pass the taken ids into the checkpointed block"
            )
        self._taken.add(layer)
        return self._ids[:, layer]

    def finish(self) -> None:
        """Check that every layer consumed its routes."""
        missing = sorted(set(range(self._layers)) - self._taken)
        if missing:
            raise MoEDeterminismError(
                f"routes of layers {missing} were recorded but never replayed"
            )
