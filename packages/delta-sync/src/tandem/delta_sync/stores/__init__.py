"""Where versions live: a local directory, an S3-compatible bucket, or an HTTP server."""

from tandem.delta_sync.stores.base import Store
from tandem.delta_sync.stores.http import HttpStore
from tandem.delta_sync.stores.local import LocalStore
from tandem.delta_sync.stores.relay import RelayStats, RelayStore
from tandem.delta_sync.stores.s3 import S3Store


def open_store(url: str, **kwargs) -> Store:
    """A store from a URL: a path, file://PATH, s3://BUCKET/PREFIX or http(s)://HOST/PATH."""
    if url.startswith(("http://", "https://")):
        return HttpStore(url, **kwargs)
    if url.startswith("s3://"):
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        return S3Store(bucket, prefix, **kwargs)
    return LocalStore(url.removeprefix("file://"), **kwargs)


__all__ = [
    "HttpStore",
    "LocalStore",
    "RelayStats",
    "RelayStore",
    "S3Store",
    "Store",
    "open_store",
]
