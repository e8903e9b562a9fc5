"""Stage a version as a compact patch while serving, then apply it in a short pause.

`stage` (the prepare phase) needs no access to the live tensors: sparse chunks are
decompressed and checked (every position inside its chunk) into their small code streams
(about 1.3 bytes per change), which apply as a modular add onto whatever the base holds,
decoded and scattered in one compiled pass; XOR and raw chunks stay compressed until
apply, so staging costs about the delta's size, never a copy of the model.

`apply_patch` (the pause) patches every chunk in parallel and hashes it while it is hot in
cache (a chunk of sparse changes part by part, so it is read from memory once), then checks every tensor against its published digest. If a delta was applied onto
the wrong base the check fails, and the patch is undone exactly (modular add and XOR are
invertible; overwritten raw chunks were saved), so the state is left as it was.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import msgspec
import numpy as np
import xxhash

from tandem.delta_sync.codec.chunk import decode_dense
from tandem.delta_sync.codec.container import iter_shard
from tandem.delta_sync.codec.frames import RAW, SPARSE, XOR, ChunkRecord
from tandem.delta_sync.codec.sparse import (
    SparseStreams,
    apply_streams,
    apply_streams_hashed,
    decode_streams,
    decompress_sparse,
)
from tandem.delta_sync.dtypes import itemsize
from tandem.delta_sync.errors import BaseMismatchError, DeltaSyncError, IntegrityError
from tandem.delta_sync.manifest import TensorInfo
from tandem.delta_sync.parallel import ordered_map
from tandem.delta_sync.spill import Spill
from tandem.delta_sync.tensor_view import TensorView
from tandem.delta_sync.tensors import (
    HostTensor,
    chunk_digest,
    chunk_elems_for,
    combine_digest,
    n_chunks,
)

ChunkKey = tuple[str, int]


@dataclass
class ChunkOp:
    rec: ChunkRecord
    where: str
    frames: list[memoryview] | None = None  # xor/raw: decoded during apply
    sparse: SparseStreams | None = None  # sparse: decompressed and checked while staging

    @property
    def nbytes(self) -> int:
        if self.sparse is not None:
            return self.sparse.nbytes
        return sum(len(f) for f in self.frames or [])


@dataclass
class StagedPatch:
    """Per chunk, the operations that turn the base into the target, in order."""

    full: bool  # the first layer is an anchor: every chunk is overwritten
    ops: dict[ChunkKey, list[ChunkOp]] = field(default_factory=dict)
    changed: int = 0

    @property
    def nbytes(self) -> int:
        return sum(op.nbytes for ops in self.ops.values() for op in ops)


def stage(
    shards: Iterable[tuple[bytes | memoryview, str]],
    targets: Mapping[str, TensorInfo],
    *,
    full: bool,
    chunk_bytes: int,
    pool: ThreadPoolExecutor,
    label: str,
    spill: Spill | None = None,
) -> StagedPatch:
    """Decode shards [(shard bytes, where), ...], in the order of their payloads (an anchor
    first when `full`, then deltas oldest first), into a StagedPatch.

    `shards` may be a generator that yields each shard as its download finishes: a shard's
    sparse chunks are decompressed on `pool` while the next ones are still downloading, so
    what is left after the last byte is that shard's work, not the whole delta's. With
    `spill`, each shard's decoded streams are moved there as soon as they are decoded, so
    staging holds a few chunks in memory, not the whole delta."""
    patch = StagedPatch(full=full)

    def ops() -> Iterator[tuple[ChunkOp, int, int, int]]:
        """Every chunk's op, shard by shard as they arrive; the sparse ones are yielded
        (op, elements, itemsize, shard) to be decompressed."""
        for shard, (data, where) in enumerate(shards, 1):
            for name, rec, frames in iter_shard(data, where):
                info = targets.get(name)
                if info is None:
                    raise IntegrityError(f"{where}: chunk of unknown tensor {name!r}")
                w = itemsize(info.dtype)
                ce = chunk_elems_for(w, chunk_bytes)
                numel = int(np.prod(info.shape, dtype=np.int64))
                if not 0 <= rec.chunk < n_chunks(numel, ce):
                    raise IntegrityError(f"{where}: tensor {name!r} has no chunk {rec.chunk}")
                n = min(ce, numel - rec.chunk * ce)
                op = ChunkOp(rec, f"{where}, tensor {name!r} chunk {rec.chunk}", frames=frames)
                patch.ops.setdefault((name, rec.chunk), []).append(op)
                if rec.mode == SPARSE:
                    patch.changed += rec.count
                    yield op, n, w, shard
                elif rec.mode in (XOR, RAW):
                    patch.changed += rec.count
                else:
                    raise IntegrityError(f"{op.where}: unknown chunk mode {rec.mode}")

    def decode(item: tuple[ChunkOp, int, int, int]) -> tuple[ChunkOp, int]:
        op, n, w, shard = item
        op.sparse = decompress_sparse(op.rec, op.frames, n, w, op.where)  # type: ignore[arg-type]
        op.frames = None
        return op, shard

    batch: list[ChunkOp] = []
    current = 0
    for op, shard in ordered_map(pool, decode, ops(), 4 * (pool._max_workers or 1)):
        if spill is None:
            continue
        if batch and shard != current:
            _spill(spill, batch)
        batch.append(op)
        current = shard
    if spill is not None and batch:
        _spill(spill, batch)
    if patch.full:
        _check_whole_anchor(patch, targets, chunk_bytes, label)
    return patch


def _check_whole_anchor(
    patch: StagedPatch, targets: Mapping[str, TensorInfo], chunk_bytes: int, label: str
) -> None:
    """An anchor overwrites every chunk: each one must start with a raw op."""
    for name, info in targets.items():
        ce = chunk_elems_for(itemsize(info.dtype), chunk_bytes)
        for c in range(n_chunks(int(np.prod(info.shape, dtype=np.int64)), ce)):
            ops = patch.ops.get((name, c))
            if not ops or ops[0].rec.mode != RAW:
                raise IntegrityError(f"{label}: the anchor lacks chunk {c} of {name!r}")


def _spill(spill: Spill, batch: list[ChunkOp]) -> None:
    """Move one shard's decoded streams to the spill file (one mapping per shard)."""
    streams = [op.sparse for op in batch]
    arrays = [a for s in streams for a in msgspec.structs.astuple(s)]  # type: ignore[arg-type]
    kept = spill.keep(arrays)
    width = len(arrays) // len(batch)
    for i, op in enumerate(batch):
        op.sparse = SparseStreams(*kept[i * width : (i + 1) * width])
    batch.clear()


def check_targets(
    views: Mapping[str, TensorView], targets: Mapping[str, TensorInfo], label: str
) -> None:
    for name, info in targets.items():
        if name not in views:
            raise DeltaSyncError(f"{label}: the state has no tensor {name!r}; pass the full state")
        v = views[name]
        if v.dtype != info.dtype or list(v.shape) != list(info.shape):
            raise DeltaSyncError(
                f"{label}: tensor {name!r} is {v.dtype}{list(v.shape)} here but "
                f"{info.dtype}{info.shape} in the published version"
            )


def _run(
    view: TensorView, start: int, stop: int, ops: list[ChunkOp], keep_undo: bool
) -> np.ndarray | None:
    """Apply ops to one chunk; returns the previous bits when a raw op makes them unrecoverable.

    Dense frames are all decoded before the first write, so a corrupt frame leaves the
    chunk untouched.
    """
    n, w = stop - start, view.itemsize
    dense = [
        None if op.rec.mode == SPARSE else decode_dense(op.rec, op.frames, n, w, op.where)  # type: ignore[arg-type]
        for op in ops
    ]
    saved = None
    if keep_undo and any(op.rec.mode == RAW for op in ops):
        saved = np.array(view.read(start, stop), copy=True)
    for op, vals in zip(ops, dense, strict=True):
        if op.rec.mode == SPARSE:
            _add(view, start, stop, op.sparse)  # type: ignore[arg-type]
        elif op.rec.mode == XOR:
            view.xor_at(start, vals)  # type: ignore[arg-type]
        else:
            view.write(start, vals)  # type: ignore[arg-type]
    return saved


def _add(
    view: TensorView, start: int, stop: int, s: SparseStreams, *, negate: bool = False
) -> None:
    """Patch one chunk with a sparse op: decoded straight into host memory, or into
    positions and differences for a device tensor."""
    if isinstance(view, HostTensor):
        apply_streams(view.flat[start:stop], s, negate=negate)
        return
    idx, diff = decode_streams(s, view.itemsize)
    view.add_at(start, idx, np.zeros_like(diff) - diff if negate else diff)


def _undo(view: TensorView, start: int, stop: int, ops: list[ChunkOp], saved) -> None:
    if saved is not None:
        view.write(start, saved)
        return
    for op in reversed(ops):
        if op.rec.mode == SPARSE:
            _add(view, start, stop, op.sparse, negate=True)  # type: ignore[arg-type]
        else:
            n, w = stop - start, view.itemsize
            view.xor_at(start, decode_dense(op.rec, op.frames, n, w, op.where))  # type: ignore[arg-type]


def apply_patch(
    patch: StagedPatch,
    views: Mapping[str, TensorView],
    targets: Mapping[str, TensorInfo],
    *,
    chunk_bytes: int,
    pool: ThreadPoolExecutor,
    label: str,
    sources: Mapping[str, str] | None = None,
) -> None:
    """Patch `views` in place and verify every tensor; on a mismatch undo and raise.

    `sources` names, per view, the stored tensor whose chunks it gets (a tied tensor's
    alias held as a separate tensor gets its stored name's); default: its own name.
    """
    check_targets(views, targets, label)
    src = sources or {}
    tasks: list[tuple[str, int, int, int]] = []
    hashes: dict[str, list[bytes]] = {}
    for name in targets:
        view = views[name]
        ce = chunk_elems_for(view.itemsize, chunk_bytes)
        nc = n_chunks(view.numel, ce)
        hashes[name] = [b""] * nc
        tasks.extend((name, c, c * ce, min((c + 1) * ce, view.numel)) for c in range(nc))

    def work(task: tuple[str, int, int, int]):
        name, c, start, stop = task
        view = views[name]
        ops = patch.ops.get((src.get(name, name), c))
        streams = [op.sparse for op in ops or [] if op.sparse is not None]
        if ops and isinstance(view, HostTensor) and len(streams) == len(ops):
            # the common case: patched and hashed part by part, read from memory once
            hasher = xxhash.xxh3_128()
            apply_streams_hashed(view.flat[start:stop], streams, hasher)
            done.append((name, c, start, stop, None))
            return name, c, hasher.digest()
        if ops:
            saved = _run(view, start, stop, ops, keep_undo=not patch.full)
            done.append((name, c, start, stop, saved))  # list.append is atomic
        return name, c, chunk_digest(view.read(start, stop))

    done: list[tuple[str, int, int, int, np.ndarray | None]] = []
    error: Exception | None = None
    try:
        for name, c, digest in ordered_map(pool, work, tasks, 64):
            hashes[name][c] = digest
    except Exception as e:  # a chunk failed to decode: roll back what was written
        error = e
    bad = None
    if error is None:
        bad = next(
            (
                n
                for n, info in targets.items()
                if combine_digest(info.dtype, tuple(info.shape), hashes[n]) != info.digest
            ),
            None,
        )
    if error is None and bad is None:
        return
    if patch.full:
        raise IntegrityError(
            f"{label}: tensor {bad!r} does not match its published digest after writing the "
            "anchor; the state is inconsistent: pull again"
        ) from error
    list(
        ordered_map(
            pool,
            lambda d: _undo(views[d[0]], d[2], d[3], patch.ops[(src.get(d[0], d[0]), d[1])], d[4]),
            done,
            64,
        )
    )
    if error is not None:
        raise error
    raise BaseMismatchError(
        f"{label}: after patching, tensor {bad!r} does not match the published digest, so the "
        "state was not the delta's base version; the patch was undone and nothing changed "
        "(pull with version=None from an anchor, or pass the state of the base version)"
    )
