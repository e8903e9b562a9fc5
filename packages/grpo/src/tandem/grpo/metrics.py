"""Step metrics accumulated over micro-batches and reduced over processes in two collectives.

Token-level metrics are carried as sums (mean x tokens) so the reduced value is the exact
token mean of the global batch, independent of how it was split; maxima are reduced with max.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class MetricSums:
    """Named running sums and maxima of 0-d tensors, kept on device until `reduce`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sums: dict[str, torch.Tensor] = {}
        self.maxes: dict[str, torch.Tensor] = {}

    def add(self, name: str, value: torch.Tensor | float) -> None:
        value = torch.as_tensor(value, dtype=torch.float64, device=self.device).detach()
        self.sums[name] = (
            self.sums.get(name, torch.zeros((), dtype=torch.float64, device=self.device)) + value
        )

    def max(self, name: str, value: torch.Tensor | float) -> None:
        value = torch.as_tensor(value, dtype=torch.float64, device=self.device).detach()
        prev = self.maxes.get(name)
        self.maxes[name] = value if prev is None else torch.maximum(prev, value)

    def reduce(
        self,
        sum_fn: Callable[[torch.Tensor], torch.Tensor],
        max_fn: Callable[[torch.Tensor], torch.Tensor],
        sum_names: list[str],
        max_names: list[str],
    ) -> dict[str, float]:
        """Reduce the named sums and maxima (missing names count as 0) to python floats."""
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        sums = torch.stack([self.sums.get(n, zero) for n in sum_names]) if sum_names else None
        maxes = torch.stack([self.maxes.get(n, zero) for n in max_names]) if max_names else None
        out: dict[str, float] = {}
        if sums is not None:
            out.update(zip(sum_names, sum_fn(sums).tolist(), strict=True))
        if maxes is not None:
            out.update(zip(max_names, max_fn(maxes).tolist(), strict=True))
        return out
