"""Rotary position embedding: the frequencies (plain, or Llama 3's scaled ones) and the two
layouts of the rotated pairs (halves, as Llama and Qwen; interleaved, as DeepSeek-V3).

Everything is elementwise per position, so a token's rotation does not depend on which other
tokens are in the batch: nothing here needs a batch-invariant kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tandem.moe_determinism.model.config import RopeScaling


def inverse_frequencies(dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """inv_freq [dim / 2] in fp32, as transformers computes it for ``default`` and ``llama3``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if scaling is None:
        return inv_freq
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


@dataclass
class Rope:
    """cos/sin [N, dim] of every token's position (``cat(freqs, freqs)``), and the layout."""

    cos: torch.Tensor
    sin: torch.Tensor
    interleaved: bool = False

    @classmethod
    def at(
        cls,
        positions: torch.Tensor,
        dim: int,
        theta: float,
        scaling: RopeScaling | None = None,
        interleaved: bool = False,
    ) -> Rope:
        inv_freq = inverse_frequencies(dim, theta, scaling).to(positions.device)
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return cls(emb.cos(), emb.sin(), interleaved)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, H, dim] rotated."""
        cos, sin = self.cos[:, None].to(x.dtype), self.sin[:, None].to(x.dtype)
        if self.interleaved:
            # pairs (x0, x1), (x2, x3), ... each turned by one angle; the result holds the
            # first members, then the second ones (the same for q and k, so q.k is unchanged)
            half = x.shape[-1] // 2
            c, s = cos[..., :half], sin[..., :half]
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return (x * cos) + (rotated * sin)
