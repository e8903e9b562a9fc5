"""A read-only store over HTTP(S): the package's own server, a relay, or any static host."""

from __future__ import annotations

import time
import urllib.error
import urllib.parse
import urllib.request

import structlog

from tandem.delta_sync.errors import NotFoundError, StoreError
from tandem.delta_sync.stores.base import Store, check_key

log = structlog.get_logger()


class HttpStore(Store):
    """GETs `base_url/key`; transient failures are retried with exponential backoff."""

    read_only = True

    def __init__(
        self, base_url: str, *, timeout: float = 60.0, retries: int = 3, backoff: float = 0.5
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise StoreError(f"HttpStore needs an http(s):// URL, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff

    def describe(self) -> str:
        return self.base_url

    def _url(self, key: str) -> str:
        return f"{self.base_url}/{urllib.parse.quote(check_key(key))}"

    def _request(self, key: str, method: str) -> bytes | None:
        url = self._url(key)
        for attempt in range(self.retries + 1):
            try:
                req = urllib.request.Request(url, method=method)
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    body = resp.read()
                    length = resp.headers.get("Content-Length")
                    if method == "GET" and length is not None and int(length) != len(body):
                        raise OSError(f"short read: {len(body)} of {length} bytes")
                    return body
            except urllib.error.HTTPError as e:
                if e.code == 404:
                    return None
                if e.code < 500 and e.code != 429:
                    raise StoreError(f"GET {url}: HTTP {e.code} {e.reason}") from None
                err: Exception = e
            except (OSError, urllib.error.URLError) as e:  # refused, reset, timeout, short read
                err = e
            if attempt < self.retries:
                log.warning("delta_sync.http_retry", url=url, attempt=attempt + 1, error=str(err))
                time.sleep(self.backoff * 2**attempt)
        raise StoreError(
            f"{method} {url} failed after {self.retries + 1} attempts ({err}); "
            "is the server up and reachable?"
        )

    def get(self, key: str) -> bytes:
        body = self._request(key, "GET")
        if body is None:
            raise NotFoundError(f"{key!r} not found at {self.base_url}")
        return body

    def exists(self, key: str) -> bool:
        return self._request(key, "HEAD") is not None

    def put(self, key: str, data: bytes) -> None:
        raise self._read_only_error(key)
