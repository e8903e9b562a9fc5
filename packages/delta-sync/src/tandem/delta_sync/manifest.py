"""The manifest: the commit record of one published version, written after all its shards.

A version is made of one or more independently published *parts* (one, or with per-rank
publishing one per trainer rank, each listing its own tensors; see `group`). Each part
offers one or more *payloads* that produce the version from a given base:

* ``full``   : every chunk raw (an anchor; needs no base),
* ``delta``  : changes against ``base_version`` (the previous version: the step delta; or
  the version's anchor: the catch-up delta, so a far-behind reader needs anchor + one delta).

Tied tensors (one tensor under two names) are stored once: a part lists the stored name in
``tensors`` and the other under ``aliases`` (alias -> stored name). Such a manifest has
format 2, which readers that know nothing of aliases refuse; one without aliases keeps
format 1, byte for byte.

A stream's `latest` pointer names its newest committed version; it is written after that
version's manifest, so a reader that finds it finds the manifest too.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Literal

import msgspec

from tandem.delta_sync.dtypes import itemsize
from tandem.delta_sync.errors import DeltaSyncError, IntegrityError, NotFoundError

if TYPE_CHECKING:  # for annotations only: the stores package imports this module
    from tandem.delta_sync.stores.base import Store

MANIFEST_FORMAT = 1
ALIASES_FORMAT = 2  # the format of a manifest with aliases (tied tensors)
READ_FORMATS = (MANIFEST_FORMAT, ALIASES_FORMAT)
LATEST_KEY = "latest"


class TensorInfo(msgspec.Struct, frozen=True):
    name: str
    dtype: str
    shape: list[int]
    digest: str  # see tensors.combine_digest


class ShardRef(msgspec.Struct, frozen=True):
    key: str
    nbytes: int
    digest: str  # xxh3-128 of the shard's bytes


class Payload(msgspec.Struct, frozen=True):
    kind: Literal["full", "delta"]
    base_version: int | None
    base_digest: str | None
    shards: list[ShardRef]
    changed: int  # elements that differ from the base (all elements for a full payload)
    chunks: dict[str, int]  # encoded chunks per mode

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards)


class Part(msgspec.Struct, frozen=True, omit_defaults=True):
    name: str
    tensors: list[TensorInfo]
    payloads: list[Payload]
    aliases: dict[str, str] = {}  # tied tensors: alias name -> name in `tensors`

    def bases(self) -> set[int | None]:
        """Base versions this part has a payload from (None = full)."""
        return {p.base_version if p.kind == "delta" else None for p in self.payloads}

    def payload_from(self, base: int | None) -> Payload | None:
        for p in self.payloads:
            if (base is None and p.kind == "full") or (
                p.kind == "delta" and p.base_version == base
            ):
                return p
        return None


class Manifest(msgspec.Struct, frozen=True):
    format: int
    version: int
    anchor_version: int
    chunk_bytes: int
    digest: str  # tensors.state_digest over every tensor of every part
    created_at: float
    parts: list[Part]

    def tensors(self, parts: Collection[str] | None = None) -> dict[str, TensorInfo]:
        """Every tensor of the version, or only those of the named parts."""
        if parts is not None:
            missing = set(parts) - {p.name for p in self.parts}
            if missing:
                raise DeltaSyncError(
                    f"version {self.version} has no part {sorted(missing)[0]!r} (its parts: "
                    f"{[p.name for p in self.parts]})"
                )
        return {
            t.name: t for p in self.parts if parts is None or p.name in parts for t in p.tensors
        }

    def aliases(self, parts: Collection[str] | None = None) -> dict[str, str]:
        """Tied tensors of the version (or of the named parts): alias -> stored name."""
        return {
            a: s
            for p in self.parts
            if parts is None or p.name in parts
            for a, s in p.aliases.items()
        }

    def bases(self) -> set[int | None]:
        """Base versions for which every part has a payload (None = full)."""
        sets = [part.bases() for part in self.parts]
        return set.intersection(*sets) if sets else set()

    def step_base(self) -> int | None:
        """The newest earlier version this one has a delta from (its step delta's base)."""
        return max((b for b in self.bases() if b is not None and b < self.version), default=None)

    def payload_bytes(self, base: int | None) -> int:
        total = 0
        for part in self.parts:
            p = part.payload_from(base)
            if p is None:
                raise DeltaSyncError(f"version {self.version}: part {part.name!r} has no {base}")
            total += p.nbytes
        return total

    @property
    def dense_bytes(self) -> int:
        n = 0
        for t in self.tensors().values():
            k = itemsize(t.dtype)
            for s in t.shape:
                k *= s
            n += k
        return n


class PartRecord(msgspec.Struct, frozen=True):
    """One part of a version, written by its publisher (a trainer rank) after its shards;
    the group's committer gathers these into the manifest."""

    version: int
    anchor_version: int
    chunk_bytes: int
    part: Part


class Latest(msgspec.Struct, frozen=True):
    version: int
    digest: str


def manifest_key(version: int) -> str:
    return f"versions/{version:012d}/manifest.json"


def part_key(version: int, name: str) -> str:
    return f"versions/{version:012d}/parts/{name}.json"


def encode_manifest(m: Manifest) -> bytes:
    return msgspec.json.encode(m)


def decode_manifest(data: bytes, version: int | None = None) -> Manifest:
    try:
        m = msgspec.json.decode(data, type=Manifest)
    except msgspec.DecodeError as e:
        raise IntegrityError(f"manifest of version {version}: unreadable ({e})") from None
    if m.format not in READ_FORMATS:
        raise DeltaSyncError(
            f"manifest of version {m.version} has format {m.format}; this build reads "
            f"{' and '.join(map(str, READ_FORMATS))} (upgrade tandem-delta-sync)"
        )
    if version is not None and m.version != version:
        raise IntegrityError(f"manifest at version {version} says it is version {m.version}")
    return m


def encode_latest(latest: Latest) -> bytes:
    return msgspec.json.encode(latest)


def decode_latest(data: bytes) -> Latest:
    try:
        return msgspec.json.decode(data, type=Latest)
    except msgspec.DecodeError as e:
        raise IntegrityError(f"unreadable `latest` pointer ({e})") from None


def read_latest(store: Store) -> Latest | None:
    """The store's `latest` pointer; None before anything was published to it."""
    try:
        return decode_latest(store.get(LATEST_KEY))
    except NotFoundError:
        return None
