"""Where versions live: a local directory, an S3-compatible bucket, or an HTTP server."""

import re

from tandem.delta_sync.errors import StoreError
from tandem.delta_sync.stores.base import Store
from tandem.delta_sync.stores.http import HttpStore
from tandem.delta_sync.stores.local import LocalStore
from tandem.delta_sync.stores.relay import RelayStats, RelayStore
from tandem.delta_sync.stores.s3 import S3Store


def open_store(url: str, **kwargs) -> Store:
    """A store from a URL: a path, file://PATH, s3://BUCKET/PREFIX or http(s)://HOST/PATH."""
    match = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://", url)
    scheme = match.group(1).lower() if match else None
    if scheme in ("http", "https"):
        return HttpStore(url, **kwargs)
    if scheme == "s3":
        bucket, _, prefix = url[len("s3://") :].partition("/")
        return S3Store(bucket, prefix, **kwargs)
    if scheme not in (None, "file"):
        raise StoreError(
            f"unknown store scheme {scheme!r} in {url!r}: a store is a directory, "
            "file://DIR, s3://BUCKET/PREFIX or http(s)://HOST/PATH"
        )
    return LocalStore(url[len("file://") :] if scheme else url, **kwargs)


__all__ = [
    "HttpStore",
    "LocalStore",
    "RelayStats",
    "RelayStore",
    "S3Store",
    "Store",
    "open_store",
]
