"""A store on a local or shared filesystem (NFS, Lustre, a mounted bucket)."""

from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path

from tandem.delta_sync.errors import NotFoundError, StoreError
from tandem.delta_sync.stores.base import Store, check_key


def os_error_message(e: OSError) -> str:
    if e.errno == errno.ENOSPC:
        return "disk full (ENOSPC): free space, then rerun (finished shards are reused)"
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"not writable ({e.strerror})"
    return f"{e.strerror or e}"


class LocalStore(Store):
    """Objects are files under `root`; writes go to a temporary file, then os.replace."""

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = False) -> None:
        self.root = Path(root)
        self.fsync = fsync

    def describe(self) -> str:
        return str(self.root)

    def missing(self) -> str | None:
        if self.root.is_dir():
            return None
        if self.root.exists():
            return f"store {self.root} is not a directory (a store is a directory of versions)"
        return (
            f"store directory {self.root} does not exist (check the path); nothing has been "
            "published there"
        )

    def path(self, key: str) -> Path:
        return self.root / check_key(key)

    def get(self, key: str) -> bytes:
        try:
            return self.path(key).read_bytes()
        except FileNotFoundError:
            raise NotFoundError(f"{key!r} not found in {self.root}") from None
        except OSError as e:
            raise StoreError(f"reading {key!r} from {self.root}: {os_error_message(e)}") from e

    def exists(self, key: str) -> bool:
        return self.path(key).is_file()

    def put(self, key: str, data: bytes) -> None:
        path = self.path(key)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise StoreError(f"writing {key!r} to {self.root}: {os_error_message(e)}") from e
