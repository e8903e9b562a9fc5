"""The one exception type of tandem-delta-sync, and the few refinements callers branch on."""

from __future__ import annotations


class DeltaSyncError(Exception):
    """Anything that went wrong while encoding, publishing, pulling or applying a delta.

    Messages say which version / shard / tensor was involved and what to do about it.
    """


class IntegrityError(DeltaSyncError):
    """Bytes or a reconstructed tensor did not match their recorded digest."""


class BaseMismatchError(DeltaSyncError):
    """A delta was applied onto a state that is not the version it was computed against."""


class StoreError(DeltaSyncError):
    """A store could not be read or written (unreachable, permission, disk full, ...)."""


class NotFoundError(StoreError):
    """A key does not exist in the store."""
