"""A read-only store over HTTP(S): the package's own server, a relay, or any static host."""

from __future__ import annotations

import http.client
import threading
import time
import urllib.parse

import structlog

from tandem.delta_sync.errors import NotFoundError, StoreError
from tandem.delta_sync.stores.base import MAX_WAIT_S, Store, check_key

log = structlog.get_logger()

# A reused connection the server closed while it sat idle fails like this before any byte
# of the answer: the request is sent again on a new connection, not counted as a retry.
_STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)


class HttpStore(Store):
    """GETs `base_url/key` over kept-alive connections; transient failures are retried with
    exponential backoff.

    Connections are reused (HTTP/1.1 keep-alive) because on a long link a new one costs a
    round trip before the request's own: at 250 ms, a pull of `latest`, a manifest and a
    few shards would spend more time opening connections than moving bytes. At most
    `max_idle` idle connections are kept; a request finding none opens a new one, so
    parallel downloads are not limited by the pool.
    """

    read_only = True

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 60.0,
        retries: int = 3,
        backoff: float = 0.5,
        max_idle: int = 16,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise StoreError(f"HttpStore needs an http(s):// URL, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        parts = urllib.parse.urlsplit(self.base_url)
        if not parts.hostname:
            raise StoreError(f"HttpStore needs a host in its URL, got {base_url!r}")
        self._https = parts.scheme == "https"
        self._host, self._port = parts.hostname, parts.port
        self._path = parts.path
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self.max_idle = max_idle
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def describe(self) -> str:
        return self.base_url

    def _url(self, key: str) -> str:
        return f"{self.base_url}/{urllib.parse.quote(check_key(key))}"

    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        """(a connection, whether it was reused from the idle pool)."""
        with self._lock:
            if self._idle:
                return self._idle.pop(), True
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        return cls(self._host, self._port, timeout=self.timeout), False

    def _release(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if len(self._idle) < self.max_idle:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        """Close the idle connections (new ones are opened if the store is used again)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _once(self, path: str, method: str) -> tuple[int, str, bytes]:
        """One request: (status, reason, body), on a reused connection when one is idle."""
        while True:
            conn, reused = self._connection()
            try:
                conn.request(method, path)
                resp = conn.getresponse()
                body = resp.read()
            except _STALE:
                conn.close()
                if reused:  # closed while idle; so, probably, are the other idle ones
                    self.close()
                    continue
                raise
            except BaseException:
                conn.close()
                raise
            length = resp.getheader("Content-Length")
            if resp.will_close:
                conn.close()
            else:
                self._release(conn)
            if method == "GET" and length is not None and int(length) != len(body):
                raise OSError(f"short read: {len(body)} of {length} bytes")
            return resp.status, resp.reason, body

    def _request(self, key: str, method: str, wait: float = 0.0) -> bytes | None:
        url = self._url(key)
        path = f"{self._path}/{urllib.parse.quote(key)}"
        if wait > 0:
            path += f"?wait={wait:.3f}"
        for attempt in range(self.retries + 1):
            try:
                status, reason, body = self._once(path, method)
                if status == 404:
                    return None
                if status < 300:
                    return body
                if status < 500 and status != 429:
                    raise StoreError(f"{method} {url}: HTTP {status} {reason}")
                err: Exception = OSError(f"HTTP {status} {reason}")
            except (OSError, http.client.HTTPException) as e:  # refused, reset, timeout, short
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

    def get_wait(self, key: str, wait: float) -> bytes:
        # the server holds the request until the object is there: no round trip after;
        # the wait stays well inside the socket timeout, so a held request is not a failure
        wait = min(wait, self.timeout / 2, MAX_WAIT_S)
        body = self._request(key, "GET", wait) if wait > 0 else self._request(key, "GET")
        if body is None:
            raise NotFoundError(f"{key!r} not found at {self.base_url} (waited {wait:.1f} s)")
        return body

    def exists(self, key: str) -> bool:
        return self._request(key, "HEAD") is not None

    def put(self, key: str, data: bytes) -> None:
        raise self._read_only_error(key)
