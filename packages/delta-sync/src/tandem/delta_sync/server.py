"""A read-only HTTP server for a LocalStore directory (`delta-sync serve ROOT`).

Run one next to each inference cluster on a mirror of the origin store (a per-region
relay), or in front of a shared filesystem. Only GET and HEAD of valid store keys are
served; anything else is refused.
"""

from __future__ import annotations

import shutil
import threading
import urllib.parse
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import structlog

from tandem.delta_sync.errors import StoreError
from tandem.delta_sync.stores.base import check_key

log = structlog.get_logger()


class _Handler(BaseHTTPRequestHandler):
    server_version = "delta-sync"
    protocol_version = "HTTP/1.1"
    root: Path

    def _resolve(self) -> Path | None:
        key = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path.lstrip("/"))
        try:
            check_key(key)
        except StoreError:
            return None
        path = self.root / key
        return path if path.is_file() else None

    def _head(self) -> Path | None:
        path = self._resolve()
        if path is None:
            self.send_error(HTTPStatus.NOT_FOUND)
            return None
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(path.stat().st_size))
        self.end_headers()
        return path

    def do_HEAD(self) -> None:
        self._head()

    def do_GET(self) -> None:
        path = self._head()
        if path is not None:
            with open(path, "rb") as f:
                shutil.copyfileobj(f, self.wfile, 1 << 20)

    def _refuse(self) -> None:
        self.send_error(HTTPStatus.METHOD_NOT_ALLOWED, "read-only store")

    do_PUT = do_POST = do_DELETE = do_PATCH = _refuse

    def log_message(self, format: str, *args) -> None:
        log.debug("delta_sync.http", client=self.client_address[0], request=format % args)


class StoreServer:
    """Serve `root` on host:port (port 0 picks a free one) from a background thread."""

    def __init__(self, root: str | Path, host: str = "127.0.0.1", port: int = 0) -> None:
        root = Path(root)
        if not root.is_dir():
            raise StoreError(f"cannot serve {root}: not a directory")
        handler = type("Handler", (_Handler,), {"root": root.resolve()})
        self.httpd = ThreadingHTTPServer((host, port), handler)
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
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> StoreServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
