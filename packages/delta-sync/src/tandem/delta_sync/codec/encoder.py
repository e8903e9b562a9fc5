"""Encode a whole state (against a base, or in full) into shards, chunk by chunk in parallel.

The same pass hashes every chunk of the new state, so the per-tensor digests come for free
with the first payload of a version.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import xxhash

from tandem.delta_sync.codec.chunk import encode_chunk
from tandem.delta_sync.codec.container import ShardBuilder
from tandem.delta_sync.codec.frames import MODE_NAMES, EncodedChunk
from tandem.delta_sync.errors import DeltaSyncError
from tandem.delta_sync.manifest import TensorInfo
from tandem.delta_sync.parallel import ordered_map
from tandem.delta_sync.tensor_view import TensorView
from tandem.delta_sync.tensors import chunk_elems_for, combine_digest, n_chunks


@dataclass
class EncodeStats:
    changed: int = 0
    dense_bytes: int = 0
    chunks: dict[str, int] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)
    base_digests: dict[str, str] = field(default_factory=dict)


def check_same_names(new: Mapping[str, object], base: Mapping[str, object]) -> None:
    if set(new) != set(base):
        added, removed = sorted(set(new) - set(base)), sorted(set(base) - set(new))
        raise DeltaSyncError(
            f"tensor set changed (added {added[:5]}, removed {removed[:5]}); a delta needs the "
            "same tensors as its base: publish into a new store (or prefix) to start over"
        )


def check_same_layout(new: Mapping[str, TensorView], base: Mapping[str, TensorView]) -> None:
    check_same_names(new, base)
    for name, v in new.items():
        b = base[name]
        if v.dtype != b.dtype or tuple(v.shape) != tuple(b.shape):
            raise DeltaSyncError(
                f"tensor {name!r} changed from {b.dtype}{list(b.shape)} to "
                f"{v.dtype}{list(v.shape)}; a delta needs the same layout as its base"
            )


def tensor_infos(views: Mapping[str, TensorView], digests: Mapping[str, str]) -> list[TensorInfo]:
    return [TensorInfo(n, v.dtype, list(v.shape), digests[n]) for n, v in views.items()]


def encode_state(
    new: Mapping[str, TensorView],
    base: Mapping[str, TensorView] | None,
    *,
    chunk_bytes: int,
    level: int,
    pool: ThreadPoolExecutor,
    shard_bytes: int,
    on_shard: Callable[[bytes], None],
    hash_new: bool = True,
    hash_base: bool = False,
    advance_base: bool = False,
    on_chunk: Callable[[int], None] | None = None,
) -> EncodeStats:
    """Encode `new` against `base` (None: in full), handing finished shards to on_shard.

    With `advance_base`, `base` (which the caller must own) is turned into `new` chunk by
    chunk as it is encoded; if encoding fails midway it holds a mix and must be discarded.
    With `hash_base`, the base's tensor digests are computed too, each part of a chunk
    right after it is compared, while it is still in cache (so it is read from memory once
    for both).
    """
    if hash_base and advance_base:
        raise ValueError("hash_base needs the base as it was: not with advance_base")
    if base is not None:
        check_same_layout(new, base)
    stats = EncodeStats()
    chunk_hashes: dict[str, list[bytes]] = {}
    base_hashes: dict[str, list[bytes]] = {}
    tasks: list[tuple[str, int, int]] = []
    for name, view in new.items():
        ce = chunk_elems_for(view.itemsize, chunk_bytes)
        chunk_hashes[name] = [b""] * n_chunks(view.numel, ce)
        base_hashes[name] = [b""] * len(chunk_hashes[name])
        tasks.extend((name, c, ce) for c in range(len(chunk_hashes[name])))
        stats.dense_bytes += view.numel * view.itemsize

    def work(task: tuple[str, int, int]) -> tuple[str, int, EncodedChunk | None, int, bytes, bytes]:
        name, c, ce = task
        view = new[name]
        hasher = xxhash.xxh3_128() if hash_new else None  # fed during the scan, if any
        base_hasher = xxhash.xxh3_128() if hash_base and base is not None else None
        enc, changed = encode_chunk(
            view,
            None if base is None else base[name],
            c,
            ce,
            level,
            advance_base=advance_base,
            hasher=hasher,
            base_hasher=base_hasher,
        )
        digest = b"" if hasher is None else hasher.digest()  # equals tensors.chunk_digest
        base_digest = b"" if base_hasher is None else base_hasher.digest()
        return name, c, enc, changed, digest, base_digest

    builder = ShardBuilder()
    window = 2 * (pool._max_workers or 1) + 2
    results: Iterator = ordered_map(pool, work, tasks, window)
    for name, c, enc, changed, digest, base_digest in results:
        chunk_hashes[name][c] = digest
        base_hashes[name][c] = base_digest
        stats.changed += changed
        if on_chunk is not None:
            ce = chunk_elems_for(new[name].itemsize, chunk_bytes)
            on_chunk(min(ce, new[name].numel - c * ce) * new[name].itemsize)
        if enc is None:
            continue
        mode = MODE_NAMES[enc.mode]
        stats.chunks[mode] = stats.chunks.get(mode, 0) + 1
        builder.add(name, enc)
        if builder.nbytes >= shard_bytes:
            on_shard(builder.finish())
            builder = ShardBuilder()
    if len(builder):
        on_shard(builder.finish())
    if hash_new:
        stats.digests = {
            name: combine_digest(v.dtype, tuple(v.shape), chunk_hashes[name])
            for name, v in new.items()
        }
    if hash_base and base is not None:
        stats.base_digests = {
            name: combine_digest(v.dtype, tuple(v.shape), base_hashes[name])
            for name, v in base.items()
        }
    return stats
