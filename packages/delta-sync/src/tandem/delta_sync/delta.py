"""In-memory API: a delta (or a full snapshot) between two states as one self-contained blob.

    blob = encode_delta(base, new)      # bytes
    apply_delta(state, blob)            # state (== base, bit for bit) becomes new, in place
    blob = encode_full(state); decode_full(blob) -> {name: np.ndarray}

The blob carries the base and target digest of every tensor, so applying it onto anything
but its base raises BaseMismatchError and changes nothing. A tensor under two names (tied
weights) is stored once and its other name recorded as an alias (see `aliases`).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import msgspec
import numpy as np

from tandem.delta_sync.aliases import bind, restore_aliases, split_aliases
from tandem.delta_sync.codec.container import ShardBuilder
from tandem.delta_sync.codec.encoder import check_same_names, encode_state, tensor_infos
from tandem.delta_sync.codec.patch import apply_patch, check_targets, stage
from tandem.delta_sync.dtypes import numpy_dtype
from tandem.delta_sync.errors import DeltaSyncError, IntegrityError
from tandem.delta_sync.manifest import TensorInfo
from tandem.delta_sync.parallel import default_workers
from tandem.delta_sync.tensors import views_of

BLOB_MAGIC = b"TDSB"
_PREFIX = struct.Struct("<4sI")
DEFAULT_CHUNK_BYTES = 4 << 20
DEFAULT_LEVEL = 1


class BlobMeta(msgspec.Struct):
    kind: Literal["full", "delta"]
    chunk_bytes: int
    base: list[TensorInfo] | None
    tensors: list[TensorInfo]
    aliases: dict[str, str] = {}  # tied tensors: alias -> name in `tensors`


def _pack(meta: BlobMeta, shard: bytes) -> bytes:
    header = msgspec.msgpack.encode(meta)
    return _PREFIX.pack(BLOB_MAGIC, len(header)) + header + shard


def _unpack(blob: bytes | memoryview) -> tuple[BlobMeta, memoryview]:
    mv = memoryview(blob)
    if len(mv) < _PREFIX.size:
        raise IntegrityError("not a delta-sync blob (too short)")
    magic, n = _PREFIX.unpack_from(mv)
    if magic != BLOB_MAGIC:
        raise IntegrityError(f"not a delta-sync blob (magic {magic!r})")
    try:
        meta = msgspec.msgpack.decode(mv[_PREFIX.size : _PREFIX.size + n], type=BlobMeta)
    except msgspec.DecodeError as e:
        raise IntegrityError(f"unreadable delta-sync blob header ({e})") from None
    return meta, mv[_PREFIX.size + n :]


def _encode(
    base: Mapping[str, Any] | None,
    new: Mapping[str, Any],
    chunk_bytes: int,
    level: int,
    workers: int | None,
) -> bytes:
    unique, aliases = split_aliases(new)  # the new state's tying decides what is stored
    new_v = views_of(unique)
    base_v = None
    if base is not None:
        if not isinstance(base, Mapping):
            raise DeltaSyncError(f"a state must be a mapping of name -> tensor, got {type(base)}")
        check_same_names(new, base)
        base_v = views_of({n: base[n] for n in unique})
    shards: list[bytes] = []
    with ThreadPoolExecutor(workers or default_workers()) as pool:
        stats = encode_state(
            new_v,
            base_v,
            chunk_bytes=chunk_bytes,
            level=level,
            pool=pool,
            shard_bytes=1 << 62,
            on_shard=shards.append,
            hash_base=True,
        )
    base_info = None if base_v is None else tensor_infos(base_v, stats.base_digests)
    if not shards:  # nothing changed at all: an empty shard keeps the format uniform
        shards.append(ShardBuilder().finish())
    meta = BlobMeta(
        "delta" if base is not None else "full",
        chunk_bytes,
        base_info,
        tensor_infos(new_v, stats.digests),
        aliases,
    )
    return _pack(meta, shards[0])


def encode_delta(
    base: Mapping[str, Any],
    new: Mapping[str, Any],
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    level: int = DEFAULT_LEVEL,
    workers: int | None = None,
) -> bytes:
    """Bytes that turn `base` into `new` (same names, dtypes and shapes), bit for bit."""
    return _encode(base, new, chunk_bytes, level, workers)


def encode_full(
    state: Mapping[str, Any],
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    level: int = DEFAULT_LEVEL,
    workers: int | None = None,
) -> bytes:
    """A self-contained compressed snapshot of `state` (an anchor)."""
    return _encode(None, state, chunk_bytes, level, workers)


def apply_delta(
    target: Mapping[str, Any], delta: bytes | memoryview, *, workers: int | None = None
) -> None:
    """Patch `target` in place from its base to the blob's new version (or a full blob).

    Raises BaseMismatchError, with `target` unchanged, if it is not the blob's base. Tied
    tensors may be held tied (one tensor under both names) or as separate tensors.
    """
    meta, shard = _unpack(delta)
    stored = {t.name: t for t in meta.tensors}
    label = f"{meta.kind} blob"
    views, targets, sources = bind(target, stored, meta.aliases, label)
    check_targets(views, targets, label)
    with ThreadPoolExecutor(workers or default_workers()) as pool:
        patch = stage(
            [(shard, label)],
            stored,
            full=meta.kind == "full",
            chunk_bytes=meta.chunk_bytes,
            pool=pool,
            label=label,
        )
        apply_patch(
            patch,
            views,
            targets,
            chunk_bytes=meta.chunk_bytes,
            pool=pool,
            label=label,
            sources=sources,
        )


def decode_full(
    blob: bytes | memoryview, *, workers: int | None = None, as_torch: bool = False
) -> dict[str, Any]:
    """The state stored by encode_full, as numpy arrays (bf16/fp8 through ml_dtypes), or
    with `as_torch` as torch tensors, bit for bit; a tied tensor's names are one array."""
    meta, _ = _unpack(blob)
    if meta.kind != "full":
        raise DeltaSyncError("decode_full needs a blob from encode_full; use apply_delta instead")
    arrays = {t.name: np.zeros(t.shape, numpy_dtype(t.dtype)) for t in meta.tensors}
    restore_aliases(arrays, meta.aliases)
    apply_delta(arrays, blob, workers=workers)
    if as_torch:
        from tandem.delta_sync.torch_interop import to_torch

        return to_torch(arrays)
    return arrays
