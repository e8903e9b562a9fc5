"""The state's own read-only memory-mapped files as the publisher's base for the next step.

A publisher diffs every version against the one before, so it keeps a copy of it. When the
trainer writes each checkpoint to a file and publishes it memory-mapped read-only (e.g.
`load_safetensors(path, mmap_mode="r")`), that mapping already *is* a copy of the version,
held by the page cache: keeping it costs nothing, where patching a private copy (`base_copy`)
with ~2% of the weights changed at scattered positions dirties every page of that copy, so
each step writes the whole model back to disk.

The contract (`Publisher(mapped_base=True)`): a published checkpoint file is never written
again. Write each step to a new file; deleting it, or renaming another file over its path,
is fine (the mapping keeps the data). Each file's size and modification time are recorded
when it is adopted and checked before the next publish diffs against it: a file written or
truncated meanwhile is detected and the publisher rebuilds its base from the store instead
(bit-exact, at the cost of a download). Only read-only numpy views of memory-mapped files
qualify (a writable mapping is one the caller means to write); any other state keeps the
copy path.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Mapping

import numpy as np

from tandem.delta_sync.tensor_view import TensorView
from tandem.delta_sync.tensors import HostTensor

_Stamp = tuple[int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns


class _File:
    """One mapped file: its mapping's size and the file's stamp, held through our own fd."""

    def __init__(self, mapping: mmap.mmap, path: str) -> None:
        self.mapping = mapping
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self.stamp = self._stamp()
        self.size = mapping.size()  # fstat of the mapping's own descriptor: the mapped file
        if self.size != self.stamp[2]:  # the path names another file than the one mapped
            os.close(self.fd)
            raise OSError(f"{path} is not the file that is mapped")

    def _stamp(self) -> _Stamp:
        st = os.fstat(self.fd)
        return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns

    def changed(self) -> str | None:
        if self.mapping.closed:
            return f"{self.path}: its mapping was closed"
        if self.mapping.size() != self.size or self._stamp() != self.stamp:
            return f"{self.path} was written or truncated after it was published"
        return None

    def close(self) -> None:
        os.close(self.fd)


class MappedBase:
    """Views of the state's own mapped files, kept as the base, with their files' stamps."""

    def __init__(self, views: dict[str, TensorView], files: list[_File]) -> None:
        self.views = views
        self.files = files

    def changed(self) -> str | None:
        """Why the base no longer holds the version it was adopted as (None: intact)."""
        for f in self.files:
            why = f.changed()
            if why is not None:
                return why
        return None

    def close(self) -> None:
        for f in self.files:
            f.close()
        self.files = []


def _mapping_of(flat: np.ndarray) -> tuple[mmap.mmap, str] | None:
    """(the mmap, its file's path) behind a read-only numpy view of a memory-mapped file."""
    if flat.flags.writeable:
        return None
    path = getattr(flat, "filename", None)  # np.memmap's (a str or a Path)
    obj: object = flat
    while isinstance(obj, np.ndarray):
        obj = obj.base
    if not isinstance(obj, mmap.mmap) or not isinstance(path, str | os.PathLike):
        return None
    return obj, os.fspath(path)


def adopt_mapped(views: Mapping[str, TensorView]) -> MappedBase | None:
    """The views themselves as the base, if every one is a read-only view of a memory-mapped
    file (None otherwise: the caller keeps a copy)."""
    by_mapping: dict[int, tuple[mmap.mmap, str]] = {}
    for v in views.values():
        found = _mapping_of(v.flat) if isinstance(v, HostTensor) else None
        if found is None:
            return None
        by_mapping.setdefault(id(found[0]), found)
    files: list[_File] = []
    try:
        for mapping, path in by_mapping.values():
            files.append(_File(mapping, path))
    except OSError:  # the path is gone or replaced already: no stamp to trust
        for f in files:
            f.close()
        return None
    return MappedBase(dict(views), files)
