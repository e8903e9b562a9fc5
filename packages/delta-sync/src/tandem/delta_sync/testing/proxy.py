"""An HTTP/1.1 proxy that adds round-trip time and, on request, resets a transfer midway.

A test/benchmark helper (the kernel's `netem` is not everywhere): every connection waits
half a round trip before it is opened upstream (the handshake) and every request and
every piece of a response waits half a round trip, in order, so a request on a new
connection costs the two round trips it costs on a real long link, and one on a
kept-alive connection one. It reads each request's and response's head (so it logs and
resets per request, on kept-alive connections too) and copies bodies by their
Content-Length. Rates are the links' business (`tc tbf`), not this.

It runs an asyncio loop on its own thread (started from a thread inside the namespace it
should listen in); `reset_next` arms resets of shard responses, `log` records every
request (path, bytes sent back, whether it was reset) when it ends, `started` its path
when it begins.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from typing import Any

_PIECE = 64 << 10
_BUFFERED = 8  # pieces in flight per direction and connection (512 KiB)


async def _head(reader: asyncio.StreamReader) -> bytes | None:
    """An HTTP message's head (through the blank line), None at a clean end of stream."""
    try:
        return await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as e:
        if e.partial:
            raise
        return None
    except asyncio.LimitOverrunError:
        raise ValueError("HTTP head too long") from None


def _request_line(head: bytes) -> tuple[str, str]:
    parts = head.split(b"\r\n", 1)[0].split(b" ")
    if len(parts) < 3:
        raise ValueError("not an HTTP request")
    return parts[0].decode("latin-1"), parts[1].decode("latin-1")


def _fields(head: bytes) -> dict[str, str]:
    out = {}
    for line in head.split(b"\r\n")[1:]:
        name, sep, value = line.partition(b":")
        if sep:
            out[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
    return out


class Proxy:
    def __init__(self, upstream: tuple[str, int], rtt: float) -> None:
        self.upstream = upstream
        self.half = rtt / 2
        self.resets: list[int] = []  # byte offsets at which the next shard responses are cut
        self.log: list[dict[str, Any]] = []  # requests done
        self.started: list[str] = []  # paths of requests as they begin
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: OSError | None = None

    def emit(self, **fields: Any) -> None:
        self.log.append(fields)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(self.half)  # the handshake's round trip, half of it each way
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(*self.upstream), timeout=10
            )
        except (OSError, TimeoutError):
            writer.transport.abort()
            return
        await asyncio.sleep(self.half)
        aborted = False
        try:  # one request after another on a kept-alive connection, each logged
            while not aborted:
                head = await _head(reader)
                if head is None:
                    break
                at = time.monotonic() + self.half
                method, path = _request_line(head)
                self.started.append(path)
                cut = self.resets.pop(0) if self.resets and "/shards/" in path else None
                await asyncio.sleep(max(0.0, at - time.monotonic()))
                up_writer.write(head)
                await up_writer.drain()
                sent = [0]
                more = await self.respond(up_reader, writer, method, cut, sent)
                aborted = cut is not None and sent[0] >= cut
                self.emit(path=path, bytes=sent[0], reset=aborted)
                if not more:
                    break
        except (ConnectionError, OSError, asyncio.IncompleteReadError, ValueError):
            pass
        except asyncio.CancelledError:  # the proxy stops with this connection open
            aborted = False
        finally:
            up_writer.close()
            if not aborted:
                writer.close()

    async def respond(
        self,
        src: asyncio.StreamReader,
        dst: asyncio.StreamWriter,
        method: str,
        cut: int | None,
        sent: list[int],
    ) -> bool:
        """Copy one response (head and body) from src to dst, each piece delivered half a
        round trip after it was read; False when the connection ends with it."""
        head = await _head(src)
        if head is None:
            return False
        at = time.monotonic() + self.half
        fields = _fields(head)
        status = int(head.split(b" ", 2)[1])
        keep = fields.get("connection", "").lower() != "close"
        if method == "HEAD" or status in (204, 304) or status < 200:
            length: int | None = 0
        elif "content-length" in fields:
            length = int(fields["content-length"])
        else:  # delimited by the end of the connection
            length, keep = None, False
        # bounded, like a socket buffer: a slow far side holds the near side back
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(maxsize=_BUFFERED)

        async def read() -> None:
            await queue.put((at, head))
            left = length
            while left is None or left > 0:
                data = await src.read(_PIECE if left is None else min(_PIECE, left))
                if not data:
                    break
                if left is not None:
                    left -= len(data)
                await queue.put((time.monotonic() + self.half, data))
            await queue.put((time.monotonic() + self.half, b""))

        reading = asyncio.create_task(read())
        try:
            while True:
                at_, data = await queue.get()
                await asyncio.sleep(max(0.0, at_ - time.monotonic()))
                if not data:
                    break
                if cut is not None and sent[0] + len(data) >= cut:
                    dst.write(data[: max(0, cut - sent[0])])
                    sent[0] = cut
                    sock = dst.get_extra_info("socket")
                    if sock is not None:  # RST, not FIN: a reset mid-transfer
                        sock.setsockopt(
                            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                        )
                    dst.transport.abort()
                    return False
                dst.write(data)
                sent[0] += len(data)
                await dst.drain()
        finally:
            reading.cancel()
        return keep

    def reset_next(self, after_bytes: int, count: int = 1) -> None:
        """Cut (TCP reset) the next `count` shard responses after `after_bytes` bytes."""
        self.resets.extend([after_bytes] * count)

    def start(self, host: str, port: int, timeout: float = 10.0) -> Proxy:
        """Listen on host:port from a new thread (which inherits the caller's namespace)."""
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(host, port, ready), daemon=True)
        self._thread.start()
        if not ready.wait(timeout):
            raise RuntimeError(f"proxy on {host}:{port} did not start in {timeout:g} s")
        if self._error is not None:
            raise self._error
        return self

    def _run(self, host: str, port: int, ready: threading.Event) -> None:
        async def serve() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            try:
                server = await asyncio.start_server(self.handle, host, port, backlog=256)
            except OSError as e:
                self._error = e
                ready.set()
                return
            ready.set()
            async with server:
                await self._stop.wait()

        asyncio.run(serve())

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout=10)
