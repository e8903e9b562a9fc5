"""What publish and pull report back: sizes, ratios and where the time went."""

from __future__ import annotations

import msgspec


class PayloadReport(msgspec.Struct, frozen=True):
    kind: str  # "full" or "delta"
    base_version: int | None
    nbytes: int
    changed: int
    chunks: dict[str, int]
    shards: int
    uploaded: int  # shards written by this call
    skipped: int  # shards already in the store (an earlier, interrupted attempt)


class PublishReport(msgspec.Struct, frozen=True):
    version: int
    anchor_version: int
    is_anchor: bool
    dense_bytes: int
    numel: int
    payloads: list[PayloadReport]
    seconds: float

    @property
    def step_bytes(self) -> int:
        """Bytes a subscriber one version behind downloads."""
        for p in self.payloads:
            if p.kind == "delta" and p.base_version is not None:
                return p.nbytes
        return self.payloads[0].nbytes

    @property
    def changed_fraction(self) -> float:
        deltas = [p for p in self.payloads if p.kind == "delta"]
        return deltas[0].changed / max(self.numel, 1) if deltas else 1.0

    @property
    def ratio(self) -> float:
        return self.dense_bytes / max(self.step_bytes, 1)


class PullReport(msgspec.Struct, frozen=True):
    version: int
    from_version: int | None
    path: list[tuple[int, int | None]]  # (version, base) payloads applied, None = anchor
    downloaded_bytes: int
    cached_bytes: int  # shards reused from an earlier, interrupted attempt
    changed: int
    prepare_seconds: float  # download + verify + decode, while serving
    apply_seconds: float  # the pause
