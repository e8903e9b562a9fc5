"""A TCP proxy that adds round-trip time and, on request, resets a transfer midway.

A test/benchmark helper (the kernel's `netem` is not everywhere): every connection waits
half a round trip before it is opened upstream (the handshake) and every piece of data
waits half a round trip in each direction, in order, so a request costs the two round
trips it costs on a real long link. Rates are the links' business (`tc tbf`), not this.

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
        first = await reader.read(_PIECE)
        path = first.split(b" ", 2)[1].decode("latin-1") if first.count(b" ") >= 2 else "?"
        self.started.append(path)
        cut = self.resets.pop(0) if self.resets and "/shards/" in path else None
        sent = [0]
        up = asyncio.create_task(self.pump(reader, up_writer, first, None, [0]))
        down = asyncio.create_task(self.pump(up_reader, writer, b"", cut, sent))
        await asyncio.wait([up, down], return_when=asyncio.FIRST_COMPLETED)
        await asyncio.wait([down], timeout=120)
        for task in (up, down):
            task.cancel()
        for w in (writer, up_writer):
            if cut is not None and sent[0] >= cut and w is writer:
                continue  # already reset
            w.close()
        self.emit(path=path, bytes=sent[0], reset=cut is not None and sent[0] >= cut)

    async def pump(
        self,
        src: asyncio.StreamReader,
        dst: asyncio.StreamWriter,
        first: bytes,
        cut: int | None,
        sent: list[int],
    ) -> None:
        """Copy src to dst, each piece delivered half a round trip after it was read."""
        # bounded, like a socket buffer: a slow far side holds the near side back
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(maxsize=_BUFFERED)

        async def read() -> None:
            if first:
                await queue.put((time.monotonic() + self.half, first))
            while data := await src.read(_PIECE):
                await queue.put((time.monotonic() + self.half, data))
            await queue.put((time.monotonic() + self.half, b""))

        reading = asyncio.create_task(read())
        try:
            while True:
                at, data = await queue.get()
                await asyncio.sleep(max(0.0, at - time.monotonic()))
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
                    break
                dst.write(data)
                sent[0] += len(data)
                await dst.drain()
            if cut is None and dst.can_write_eof():
                dst.write_eof()
        except (ConnectionError, OSError):
            pass
        finally:
            reading.cancel()

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
