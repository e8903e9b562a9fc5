"""The store interface: a flat key -> bytes namespace with atomic whole-object writes.

Layout of a published stream (the same on every backend):

    latest                                  {"version": v, "digest": ...}, written last
    versions/000000000042/manifest.json     the commit record of version 42
    shards/ab/ab12....tds                   content-addressed shards (xxh3-128 of the bytes)
"""

from __future__ import annotations

import re
import time
from abc import ABC, abstractmethod

from tandem.delta_sync.errors import NotFoundError, StoreError

POLL_S = 0.005  # how often a long-poll on a store without one of its own looks again
MAX_WAIT_S = 60.0  # the longest long-poll a server holds a request for
_KEY = re.compile(r"^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$")


def check_key(key: str) -> str:
    if not _KEY.match(key) or any(p in (".", "..") for p in key.split("/")):
        raise StoreError(f"invalid store key {key!r}")
    return key


class Store(ABC):
    """Where versions are published. Implementations must be safe to call from threads."""

    read_only: bool = False

    @abstractmethod
    def get(self, key: str) -> bytes:
        """The object's bytes; NotFoundError if absent, StoreError if unreachable."""

    def get_wait(self, key: str, wait: float) -> bytes:
        """`get`, waiting up to `wait` seconds for the object to appear (a long-poll: a
        subscriber asks for the next version's manifest before it is published and has it
        the moment it is, instead of a round trip after). NotFoundError if still absent.
        This default asks every few milliseconds (fine for a local store); an HTTP store
        passes the wait to its server, so the waiting costs no round trips."""
        deadline = time.monotonic() + max(0.0, wait)
        while True:
            try:
                return self.get(key)
            except NotFoundError:
                if time.monotonic() >= deadline:
                    raise
            time.sleep(POLL_S)

    @abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Write the whole object atomically (readers see the old object or the new one)."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def describe(self) -> str:
        """Where this store points, for messages (e.g. 's3://bucket/prefix')."""

    def missing(self) -> str | None:
        """Why the store itself is not there (e.g. its directory does not exist), if it can
        tell without a request; None otherwise."""
        return None

    def close(self) -> None:  # noqa: B027 (most stores hold nothing open)
        """Release what the store holds open (e.g. kept-alive connections); it may be used
        again afterwards."""

    def _read_only_error(self, key: str) -> StoreError:
        return StoreError(
            f"{self.describe()} is read-only; cannot write {key!r} (publish to the origin store)"
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()!r})"


def nothing_published(store: Store) -> NotFoundError:
    """The error for a store without a `latest` pointer: empty, or not there at all."""
    why = store.missing()
    if why is not None:
        return NotFoundError(why)
    return NotFoundError(f"nothing has been published to {store.describe()} yet")
