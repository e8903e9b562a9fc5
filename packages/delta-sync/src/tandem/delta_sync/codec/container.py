"""The shard layout: a small msgpack header listing the chunk records, then their frames.

    b"TDSH" | u8 format version | u32 header length (LE) | header | frames...

A shard is immutable and content-addressed (its key is its xxh3-128), so an interrupted
publish that is run again finds the shards it already uploaded and skips them.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

import msgspec
import xxhash

from tandem.delta_sync.codec.frames import ChunkRecord, EncodedChunk, split_frames
from tandem.delta_sync.errors import IntegrityError

MAGIC = b"TDSH"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<4sBI")


class ShardHeader(msgspec.Struct, array_like=True):
    names: list[str]
    records: list[ChunkRecord]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ShardHeader)


class ShardBuilder:
    """Accumulates encoded chunks until the shard is big enough to upload."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self._name_index: dict[str, int] = {}
        self.records: list[ChunkRecord] = []
        self.frames: list[bytes] = []
        self.nbytes = 0

    def add(self, name: str, enc: EncodedChunk) -> None:
        if name not in self._name_index:
            self._name_index[name] = len(self.names)
            self.names.append(name)
        self.records.append(
            ChunkRecord(
                self._name_index[name],
                enc.chunk,
                enc.mode,
                enc.count,
                enc.gap_width,
                enc.value_width,
                [len(f) for f in enc.frames],
            )
        )
        self.frames.extend(enc.frames)
        self.nbytes += enc.nbytes

    def __len__(self) -> int:
        return len(self.records)

    def finish(self) -> bytes:
        header = _encoder.encode(ShardHeader(self.names, self.records))
        return b"".join([_PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)), header, *self.frames])


def shard_digest(data: bytes | memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def shard_key(digest: str) -> str:
    """Content-addressed key; the two-character fan-out spreads object-store prefixes."""
    return f"shards/{digest[:2]}/{digest}.tds"


def iter_shard(
    data: bytes | memoryview, where: str
) -> Iterator[tuple[str, ChunkRecord, list[memoryview]]]:
    """(tensor name, record, plane frames) for every chunk in a shard."""
    mv = memoryview(data)
    if len(mv) < _PREFIX.size:
        raise IntegrityError(f"{where}: {len(mv)} bytes is too short to be a shard")
    magic, version, hlen = _PREFIX.unpack_from(mv)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise IntegrityError(f"{where}: not a delta-sync shard (magic {magic!r}, v{version})")
    start = _PREFIX.size + hlen
    try:
        header = _decoder.decode(mv[_PREFIX.size : start])
    except msgspec.DecodeError as e:
        raise IntegrityError(f"{where}: unreadable shard header ({e})") from None
    pos = start
    for rec in header.records:
        if not 0 <= rec.tensor < len(header.names):
            raise IntegrityError(f"{where}: record names tensor #{rec.tensor}")
        end = pos + rec.nbytes
        if end > len(mv):
            raise IntegrityError(f"{where}: truncated ({len(mv)} bytes, records need {end})")
        yield header.names[rec.tensor], rec, split_frames(rec, mv[pos:end])
        pos = end
    if pos != len(mv):
        raise IntegrityError(f"{where}: {len(mv) - pos} unexpected trailing bytes")
