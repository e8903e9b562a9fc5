"""Shards uploaded while the encoder produces the next ones, with a bound on those in flight.

The publisher hands each shard over as soon as the encoder seals it, so encoding and upload
overlap; at most `limit` uploads are in flight, which bounds the memory held by shards not
yet stored. A shard already in the store (content-addressed) is skipped.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

from tandem.delta_sync.codec.container import shard_digest, shard_key
from tandem.delta_sync.errors import StoreError
from tandem.delta_sync.manifest import ShardRef
from tandem.delta_sync.stores.base import Store


class ShardUploads:
    """The uploads of one payload: `add` each shard in order, then `finish` (or `abandon`)."""

    def __init__(
        self,
        store: Store,
        io: ThreadPoolExecutor,
        limit: int,
        label: str,
        on_upload: Callable[[int], None] | None = None,
    ) -> None:
        """``label`` names the payload in errors (e.g. "publishing version 3 (anchor)")."""
        self.store, self.io, self.limit, self.label = store, io, limit, label
        self.on_upload = on_upload
        self.refs: list[ShardRef] = []
        self.uploaded = self.skipped = 0
        self._in_flight: deque[Future[bool]] = deque()

    def _upload(self, index: int, key: str, data: bytes) -> bool:
        try:
            if self.store.exists(key):
                return False
            self.store.put(key, data)
            return True
        except StoreError as e:
            raise StoreError(
                f"{self.label}: shard {index} ({key}): {e}; "
                "the previous version is intact, publish again to resume"
            ) from e

    def _settle(self, fut: Future[bool]) -> None:
        if fut.result():
            self.uploaded += 1
        else:
            self.skipped += 1

    def add(self, data: bytes) -> None:
        digest = shard_digest(data)
        key = shard_key(digest)
        self.refs.append(ShardRef(key, len(data), digest))
        self._in_flight.append(self.io.submit(self._upload, len(self.refs) - 1, key, data))
        while len(self._in_flight) > self.limit:
            self._settle(self._in_flight.popleft())
        if self.on_upload is not None:
            self.on_upload(len(data))

    def finish(self) -> None:
        """Wait for every upload; the first failure is raised."""
        while self._in_flight:
            self._settle(self._in_flight.popleft())

    def abandon(self) -> None:
        """Cancel what has not started and wait for the rest: no upload outlives a failed
        publish."""
        for fut in self._in_flight:
            fut.cancel()
        wait(list(self._in_flight))
        self._in_flight.clear()
