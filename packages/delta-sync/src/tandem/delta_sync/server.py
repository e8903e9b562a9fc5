"""A read-only HTTP server for a store (`delta-sync serve ROOT`, `delta-sync relay ORIGIN`).

Run one next to each inference cluster: on a mirror of the origin store, in front of a
shared filesystem, or on a RelayStore that fetches from the origin on demand and caches
(a per-region relay). Only GET and HEAD of valid store keys are served; anything else is
refused. An origin that fails behind a relay answers 502, which HttpStore retries.
`GET key?wait=S` is a long-poll: an object not there yet is answered as soon as it
appears, within S seconds (at most `MAX_WAIT_S`), else 404.
"""

from __future__ import annotations

import contextlib
import errno
import shutil
import socket
import socketserver
import threading
import time
import urllib.parse
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import structlog

from tandem.delta_sync.errors import DeltaSyncError, NotFoundError, StoreError
from tandem.delta_sync.stores.base import MAX_WAIT_S, POLL_S, Store, check_key
from tandem.delta_sync.stores.local import LocalStore

log = structlog.get_logger()


class _Handler(BaseHTTPRequestHandler):
    server_version = "delta-sync"
    protocol_version = "HTTP/1.1"  # keep-alive: a long link's round trip is paid once
    timeout = 300  # an idle kept-alive connection is closed after this many seconds
    store: Store
    server: _Server

    def setup(self) -> None:
        super().setup()
        self.server.track(self.connection, True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.track(self.connection, False)

    def _key(self) -> str | None:
        key = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path.lstrip("/"))
        try:
            return check_key(key)
        except StoreError:
            return None

    def _wait(self) -> float:
        """The long-poll the request asks for (`?wait=S`), in seconds, bounded."""
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
        try:
            return min(max(float(query.get("wait", ["0"])[0]), 0.0), MAX_WAIT_S)
        except ValueError:
            return 0.0

    def _send(self, key: str | None, body: bool) -> None:
        if key is None:
            self.send_error(HTTPStatus.NOT_FOUND)
            return
        wait = self._wait() if body else 0.0
        if isinstance(self.store, LocalStore):  # stream files, no copy in memory
            path = self.store.path(key)
            deadline = time.monotonic() + wait
            while not path.is_file() and time.monotonic() < deadline:
                time.sleep(POLL_S)  # a long-poll: the publisher writes the directory itself
            if not path.is_file():
                self.send_error(HTTPStatus.NOT_FOUND)
                return
            self._headers(path.stat().st_size)
            if body:
                with open(path, "rb") as f:
                    shutil.copyfileobj(f, self.wfile, 1 << 20)
            return
        try:
            if not body:
                if not self.store.exists(key):
                    raise NotFoundError(key)
                self._headers(None)
                return
            data = self.store.get_wait(key, wait) if wait > 0 else self.store.get(key)
        except NotFoundError:
            self.send_error(HTTPStatus.NOT_FOUND)
            return
        except DeltaSyncError as e:  # the origin behind a relay is down or sent garbage
            log.warning("delta_sync.serve_error", key=key, error=str(e))
            self.send_error(HTTPStatus.BAD_GATEWAY, explain=str(e))
            return
        self._headers(len(data))
        self.wfile.write(data)

    def _headers(self, length: int | None) -> None:
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "application/octet-stream")
        if length is not None:
            self.send_header("Content-Length", str(length))
        self.end_headers()

    def do_HEAD(self) -> None:
        self._send(self._key(), body=False)

    def do_GET(self) -> None:
        self._send(self._key(), body=True)

    def _refuse(self) -> None:
        self.send_error(HTTPStatus.METHOD_NOT_ALLOWED, "read-only store")

    do_PUT = do_POST = do_DELETE = do_PATCH = _refuse

    def log_message(self, format: str, *args) -> None:
        log.debug("delta_sync.http", client=self.client_address[0], request=format % args)


class _Server(ThreadingHTTPServer):
    """No reverse DNS lookup of the address at bind (HTTPServer's getfqdn), which stalls
    for seconds where no resolver answers (an isolated network, a broken DNS setup)."""

    def server_bind(self) -> None:
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), self.server_address[1]
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()
        self._dropped = False

    def track(self, conn: socket.socket, open_: bool) -> None:
        with self._open_lock:
            if not open_:
                self._open.discard(conn)
                return
            if not self._dropped:
                self._open.add(conn)
                return
        conn.shutdown(socket.SHUT_RDWR)  # accepted as the server stopped

    def drop_connections(self) -> None:
        """A stopped server answers nothing more, on kept-alive connections either: each is
        shut down, so its clients see it closed and connect again (to a restarted server)."""
        with self._open_lock:
            conns, self._open, self._dropped = list(self._open), set(), True
        for conn in conns:
            with contextlib.suppress(OSError):  # already closed by its client
                conn.shutdown(socket.SHUT_RDWR)


class StoreServer:
    """Serve a store directory, or any Store (e.g. a RelayStore), read-only on host:port
    (port 0 picks a free one), from a background thread or in the foreground."""

    def __init__(self, source: str | Path | Store, host: str = "127.0.0.1", port: int = 0) -> None:
        if not isinstance(source, Store):
            root = Path(source)
            if not root.is_dir():
                raise StoreError(f"cannot serve {root}: not a directory")
            source = LocalStore(root.resolve())
        self.store = source
        handler = type("Handler", (_Handler,), {"store": source})
        try:
            self.httpd = _Server((host, port), handler)
        except OSError as e:
            hint = ""
            if e.errno == errno.EADDRINUSE:
                hint = ": another process listens there; stop it or pick another port"
            elif e.errno in (errno.EACCES, errno.EPERM):
                hint = ": ports below 1024 need privileges; pick a higher one"
            raise StoreError(f"cannot serve on {host}:{port} ({e.strerror or e}){hint}") from None
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> StoreServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.httpd.drop_connections()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> StoreServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
