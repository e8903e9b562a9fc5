"""The pieces every layer of the reference transformer shares: where the flat tokens of a
pass sit (`TokenLayout`), RMSNorm, the SwiGLU MLP, and the CPU thread scope of invariant ops.

Every layer works on a flat list of tokens [N, hidden] (the valid tokens of a padded or
packed batch, sequence after sequence); only attention needs to know which tokens belong
together, and it gets that from a `TokenLayout`.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tandem.moe_determinism.mode import is_batch_invariant
from tandem.moe_determinism.model.cache import KVCache
from tandem.moe_determinism.ops.workers import stock_ops_on_one_thread


def invariant_cpu_scope(x: torch.Tensor) -> AbstractContextManager[None]:
    """Around layers computing ``x`` under `batch_invariant()` on the CPU, torch's own ops run
    on the calling thread alone and the tile products get every thread
    (`stock_ops_on_one_thread`); nothing elsewhere."""
    if x.is_cuda or not is_batch_invariant():
        return nullcontext()
    return stock_ops_on_one_thread()


@dataclass
class TokenLayout:
    """Where the flat tokens of one forward pass sit.

    seq_of [N]: sequence index of each token; index [N]: its index among that sequence's new
    tokens; counts [S]: new tokens per sequence; offsets [S]: tokens already in the KV cache
    (0 without a cache); positions [N] = offsets[seq_of] + index.
    """

    seq_of: torch.Tensor
    index: torch.Tensor
    counts: torch.Tensor
    offsets: torch.Tensor
    positions: torch.Tensor
    cache: KVCache | None = None
    slots: torch.Tensor | None = None
    parents: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.counts.numel())

    @property
    def max_count(self) -> int:
        return int(self.counts.max()) if self.counts.numel() else 0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acc = x.float()
        acc = acc * torch.rsqrt(acc.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * acc.to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
