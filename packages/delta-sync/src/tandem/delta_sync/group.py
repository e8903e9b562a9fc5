"""Committing a version published in parts, one per trainer rank, with no gather of the model.

Each rank encodes and uploads the delta of its own tensors, then writes a part record
(`versions/<v>/parts/<name>.json`). The group's first rank waits for every record, checks
that they agree, and commits the version as a single publisher does: the manifest listing
every part, then `latest`. The other ranks wait for that manifest, so `publish` returns on
every rank once the version is visible to readers, and subscribers reassemble the whole
state from the parts. A rank that never publishes its part makes the commit time out with
its name; nothing is committed, and publishing the version again on every rank finishes it
(shards already uploaded are reused).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import msgspec

from tandem.delta_sync.errors import DeltaSyncError, IntegrityError, NotFoundError, StoreError
from tandem.delta_sync.manifest import (
    ALIASES_FORMAT,
    LATEST_KEY,
    MANIFEST_FORMAT,
    Latest,
    Manifest,
    Part,
    PartRecord,
    decode_manifest,
    encode_latest,
    encode_manifest,
    manifest_key,
    part_key,
    read_latest,
)
from tandem.delta_sync.stores.base import Store
from tandem.delta_sync.tensors import state_digest


def check_group(part: str, group: Sequence[str]) -> list[str]:
    names = list(group)
    if len(set(names)) != len(names):
        raise DeltaSyncError(f"group {names} names a part twice")
    if part not in names:
        raise DeltaSyncError(f"part {part!r} is not in its group {names}")
    return names


def write_part(store: Store, record: PartRecord) -> None:
    store.put(part_key(record.version, record.part.name), msgspec.json.encode(record))


def _wait(store: Store, key: str, what: str, timeout: float) -> bytes:
    """The object at `key`, polled with a growing interval until `timeout` seconds."""
    deadline = time.monotonic() + timeout
    interval = 0.02
    while True:
        try:
            return store.get(key)
        except NotFoundError:
            pass
        if time.monotonic() >= deadline:
            raise StoreError(f"{what} did not appear in {store.describe()} within {timeout:g} s")
        time.sleep(min(interval, max(deadline - time.monotonic(), 0.0)))
        interval = min(interval * 1.5, 0.5)


def commit_group(store: Store, own: PartRecord, group: Sequence[str], timeout: float) -> Manifest:
    """Gather every part record of `own.version`, check them, write manifest then latest."""
    v = own.version
    records = []
    for name in group:
        if name == own.part.name:
            records.append(own)
            continue
        data = _wait(
            store,
            part_key(v, name),
            f"version {v}: part {name!r} (is its rank running?); nothing was committed",
            timeout,
        )
        try:
            records.append(msgspec.json.decode(data, type=PartRecord))
        except msgspec.DecodeError as e:
            raise IntegrityError(f"version {v}: part record {name!r} unreadable ({e})") from None
    seen: dict[str, str] = {}
    for r in records:
        if (r.version, r.anchor_version, r.chunk_bytes) != (
            v,
            own.anchor_version,
            own.chunk_bytes,
        ):
            raise DeltaSyncError(
                f"version {v}: part {r.part.name!r} was published as version {r.version} with "
                f"anchor {r.anchor_version} and {r.chunk_bytes}-byte chunks, part "
                f"{own.part.name!r} with anchor {own.anchor_version} and {own.chunk_bytes}: "
                "every rank must publish with the same settings and history"
            )
        for name in [*(t.name for t in r.part.tensors), *r.part.aliases]:
            if name in seen:
                raise DeltaSyncError(
                    f"version {v}: tensor {name!r} is in parts {seen[name]!r} and "
                    f"{r.part.name!r}; each tensor belongs to one rank"
                )
            seen[name] = r.part.name
    if len({frozenset(r.part.bases()) for r in records}) != 1:
        raise DeltaSyncError(f"version {v}: the parts were not encoded against the same bases")
    return commit_version(store, v, own.anchor_version, own.chunk_bytes, [r.part for r in records])


def commit_version(
    store: Store, version: int, anchor_version: int, chunk_bytes: int, parts: list[Part]
) -> Manifest:
    """Write the manifest of `parts` (its digest from their tensors' digests), then `latest`:
    the atomic commit of a version, by a single publisher or a group's committer."""
    digests = {t.name: t.digest for p in parts for t in p.tensors}
    aliases = {a: s for p in parts for a, s in p.aliases.items()}
    digests.update({a: digests[s] for a, s in aliases.items()})  # a tied name has its bits
    manifest = Manifest(
        format=ALIASES_FORMAT if aliases else MANIFEST_FORMAT,
        version=version,
        anchor_version=anchor_version,
        chunk_bytes=chunk_bytes,
        digest=state_digest(digests),
        created_at=time.time(),
        parts=parts,
    )
    store.put(manifest_key(version), encode_manifest(manifest))
    store.put(LATEST_KEY, encode_latest(Latest(version, manifest.digest)))
    return manifest


def await_commit(store: Store, version: int, committer: str, timeout: float) -> Manifest:
    """The manifest of `version` once the group's committer has written it."""
    data = _wait(
        store,
        manifest_key(version),
        f"version {version}: the manifest (committed by part {committer!r})",
        timeout,
    )
    return decode_manifest(data, version)


def check_publishable(store: Store, version: int, last: int | None) -> None:
    """Refuse to publish over another publisher's stream or an existing version (``last``:
    the version this publisher published last)."""
    latest = read_latest(store)
    if latest is not None and latest.version != last:
        raise DeltaSyncError(
            f"the store's latest version is {latest.version} but this publisher last "
            f"published {last}: another publisher is writing to {store.describe()}"
        )
    if store.exists(manifest_key(version)):
        raise DeltaSyncError(f"version {version} already exists in {store.describe()}")
