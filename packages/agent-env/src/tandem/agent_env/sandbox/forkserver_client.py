"""Host side of the fork server: one long-lived sandbox per runtime that forks a fresh
sandbox per job. This module starts it, sends it jobs, moves each job into its cgroup and
ends it; the server itself, which runs inside its sandbox, is ``inside/forkserver_server.py``.

A sandbox started from scratch (bwrap, then a Python interpreter, and for grading ``import
unittest``) costs tens of milliseconds of CPU, more than an episode's tool calls or a small
hidden test suite. The fork server pays that once and forks a child per job, an episode's
supervisor or a grading run, that still gets what a fresh bwrap sandbox gives: its own mount,
pid, network, IPC, UTS and user namespaces, the workspace as an overlay (an episode's own upper
directory; for grading a throwaway one over the final workspace with the hidden tests on top),
fresh ``/tmp``, uid 1000 with no capabilities, and its own memory and pids cgroup (this side
moves it there before it runs anything).

Each job talks to this process over its own socket pair (passed to the server as SCM_RIGHTS),
so one job cannot see or forge another's traffic; the job's host pid comes from the socket's
credentials, which the kernel translates across pid namespaces. When the fork server cannot
be used, sessions and grading start sandboxes of their own (bwrap per sandbox) instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import struct
from pathlib import Path
from typing import Any

import structlog

from tandem.agent_env.judge import MAX_LINE_BYTES, Reported, read_records
from tandem.agent_env.sandbox import bwrap as bw
from tandem.agent_env.sandbox import jsonwire
from tandem.agent_env.sandbox.cgroups import EpisodeCgroup
from tandem.agent_env.sandbox.proc import ChildProcess, reap, spawn
from tandem.agent_env.sandbox.rootless import rootless_limits

log = structlog.get_logger()

_START_TIMEOUT_S = 30.0
_HANDSHAKE_TIMEOUT_S = 30.0
_MAX_FAILURES = 3
_SERVER_PIDS = 4096


class ForkServerError(Exception):
    """The fork server could not start a job (an infrastructure problem, not a job's own
    result); callers fall back to a sandbox of their own."""


class JobOutput:
    """What one grading job reported (bounded, schema-checked lines) and whether the fork
    server itself died meanwhile."""

    def __init__(self, max_records: int) -> None:
        self.reported = Reported(max_records)
        self.server_died = False


class ForkServer:
    """Client of the fork server of one :class:`~tandem.agent_env.sandbox.runtime.Runtime`."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self.proc: ChildProcess | None = None
        self.cgroup: EpisodeCgroup | None = None
        self.ctl: socket.socket | None = None
        self.starts = 0
        self.failures = 0  # consecutive failed starts; past _MAX_FAILURES it is not used
        self._lock = asyncio.Lock()  # one per event loop: the runtime keeps a server per loop
        self._root: str | None = None

    def layer_path(self, path: Path | str) -> str | None:
        """A host layer's path as the fork server sees it, or None if it cannot see it."""
        if self._root is None:
            self._root = os.path.realpath(self.runtime.root) + os.sep
        text = str(path)
        if not text.startswith(self._root):  # not built by the runtime: resolve it
            text = os.path.realpath(text)
        if not text.startswith(self._root) or "/.." in text or "/./" in text:
            return None
        return text[len(self._root) :]

    async def _ensure(self) -> None:
        loop = asyncio.get_running_loop()
        if self.proc is not None and self.proc.has_exited():
            await self._stop()
        if self.proc is not None:
            return
        if self.failures >= _MAX_FAILURES:
            raise ForkServerError(
                f"the fork server failed to start {self.failures} times; not restarting"
            )
        self.starts += 1
        rt = self.runtime
        lim = rt.config.limits
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        errlog_path = rt.root / f"forkserver-stderr{self.starts}"
        try:
            # jobs are forked here and moved to their own cgroups at once: room for many
            self.cgroup = await asyncio.to_thread(
                rt.cgroups.create, lim.memory_bytes + lim.tmp_bytes, _SERVER_PIDS, "forkserver"
            )
            argv = [
                *rt.mounts.ns_prefix,
                *bw.forkserver_args(
                    rt.bwrap, rt.config, rt.root / "etc", str(rt.root), rt.locale_dir
                ),
            ]
            argv += bw.tool_argv(rt.config.python, "forkserver_server", bw.TOOLS_MOUNT)
            argv.append(str(theirs.fileno()))
            with open(errlog_path, "wb") as errlog:
                self.proc = await spawn(argv, self.cgroup, errlog, pass_fds=(theirs.fileno(),))
            theirs.close()
            mine.setblocking(False)
            self.ctl = mine
            hello = await asyncio.wait_for(loop.sock_recv(mine, 64), _START_TIMEOUT_S)
            if hello != b"ready":
                raise ForkServerError(f"unexpected greeting {hello!r}")
        except BaseException as e:
            theirs.close()
            self.failures += 1
            await self._stop()
            detail = ""
            with contextlib.suppress(OSError):
                detail = errlog_path.read_bytes()[-800:].decode("utf-8", "replace")
            if isinstance(e, Exception):
                raise ForkServerError(f"the fork server did not start: {e!r}; {detail}") from e
            raise
        self.failures = 0
        log.info("agent_env.forkserver_started", pid=self.proc.pid if self.proc else None)

    async def _stop(self) -> None:
        if self.ctl is not None:
            self.ctl.close()
            self.ctl = None
        if self.proc is not None:
            proc, self.proc = self.proc, None
            await reap(proc, self.cgroup)
        elif self.cgroup is not None:
            await asyncio.to_thread(self.cgroup.remove)
        self.cgroup = None

    def abandon(self) -> None:
        """Stop the server and every job it started, without an event loop (the one that
        started it may be closed)."""
        if self.ctl is not None:
            self.ctl.close()
            self.ctl = None
        if self.proc is not None:
            proc, self.proc = self.proc, None
            proc.kill()
            if self.cgroup is not None:
                self.cgroup.kill_all()
            proc.abandon()
        if self.cgroup is not None:
            self.cgroup.remove()
            self.cgroup = None

    async def launch(self, job: dict[str, Any], cgroup: EpisodeCgroup) -> tuple[socket.socket, int]:
        """Start one job in ``cgroup``; returns its connected socket (non-blocking) and a
        pidfd of its init once the job runs there (end it with :func:`end_job`). Raises
        :class:`ForkServerError` if it could not be started."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        pidfd = -1
        mine.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        mine.setblocking(False)
        try:
            # one sender at a time: a full queue is waited for with one writer callback
            async with self._lock:
                await self._ensure()
                assert self.ctl is not None
                try:
                    await _send_job(self.ctl, jsonwire.encode(job), theirs.fileno())
                except OSError as e:
                    msg = f"could not send the job to the fork server: {e}"
                    raise ForkServerError(msg) from e
                finally:
                    theirs.close()
            try:
                async with asyncio.timeout(_HANDSHAKE_TIMEOUT_S):
                    pid, first = await _recv_creds(mine)
            except (TimeoutError, ConnectionError) as e:
                raise ForkServerError(f"the job did not report: {e!r}") from e
            if first != b"r":  # the server reports why it could not start the job
                rest = await _read_all(mine, 5.0)
                text = (first + rest).decode("utf-8", "replace")
                raise ForkServerError(f"the job did not start: {text}")
            try:  # the job waits for our "g": its pid cannot have been reused yet
                pidfd = os.pidfd_open(pid)
                # here, not in a worker thread: a trip to one costs more CPU than the writes
                cgroup.join(pid)
            except OSError as e:
                msg = f"could not move job {pid} into its cgroup: {e}"
                raise ForkServerError(msg) from e
            await asyncio.get_running_loop().sock_sendall(mine, b"g")
        except BaseException:
            mine.close()
            theirs.close()
            if pidfd >= 0:
                os.close(pidfd)
            raise
        return mine, pidfd

    def alive(self) -> bool:
        return self.proc is not None and not self.proc.has_exited()

    async def grade(
        self, lowers: list[str], spec: dict[str, Any], timeout_s: float, max_records: int
    ) -> JobOutput:
        """Run the hidden tests over ``lowers`` (server-side layer paths, top first) in a
        job of its own cgroup; raises :class:`ForkServerError` if it could not start."""
        rt = self.runtime
        lim = rt.config.limits
        job = {
            "kind": "grade",
            "lowers": lowers,
            "spec": spec,
            "disk": lim.disk_bytes,
            "tmp": lim.tmp_bytes,
            "fsize": lim.file_size_bytes,
            "nofile": lim.open_files,
            **rootless_limits(rt, lim),
        }
        mem = lim.memory_bytes + lim.disk_bytes + lim.tmp_bytes
        cgroup = rt.cgroups.create(mem, lim.pids)  # usually a recycled one: no thread trip
        out = JobOutput(max_records)
        pidfd = -1
        try:
            sock, pidfd = await self.launch(job, cgroup)
            reader, writer = await asyncio.open_unix_connection(sock=sock, limit=MAX_LINE_BYTES)
            try:
                async with asyncio.timeout(timeout_s):
                    await read_records(reader, out.reported)
            except TimeoutError:
                out.reported.timed_out = True
            finally:
                writer.close()
            out.server_died = not self.alive()
            return out
        finally:
            if pidfd >= 0:
                await end_job(pidfd, cgroup)
            else:
                await asyncio.to_thread(cgroup.remove)


async def kill_job(pidfd: int) -> bool:
    """SIGKILL a job's init and wait until it is gone; closes ``pidfd``. The kernel kills
    every process of a pid namespace whose init exits and lets the init finish only once
    they are all reaped, so then nothing of the job is left in its cgroup. False if the init
    did not exit in time (then kill what is in the cgroup the slow way)."""
    loop = asyncio.get_running_loop()
    try:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        gone = loop.create_future()
        loop.add_reader(pidfd, lambda: gone.done() or gone.set_result(None))
        try:
            await asyncio.wait_for(gone, 10.0)
        except TimeoutError:
            return False
        finally:
            loop.remove_reader(pidfd)
        return True
    finally:
        os.close(pidfd)


async def end_job(pidfd: int, cgroup: EpisodeCgroup) -> None:
    """Kill a job and recycle its cgroup: no worker thread and no polling of the cgroup's
    process list unless the job outlives the kill."""
    if not (await kill_job(pidfd) and cgroup.recycle()):
        await asyncio.to_thread(cgroup.remove)


async def _send_job(ctl: socket.socket, data: bytes, fd: int) -> None:
    """One job message with its socket attached; waits while the server's queue is full."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            socket.send_fds(ctl, [data], [fd])
            return
        except BlockingIOError:
            fut = loop.create_future()
            loop.add_writer(ctl.fileno(), fut.set_result, None)
            try:
                await fut
            finally:
                loop.remove_writer(ctl.fileno())


async def _recv_creds(sock: socket.socket) -> tuple[int, bytes]:
    """First bytes from a job's socket and the sender's pid (in our pid namespace)."""
    loop = asyncio.get_running_loop()
    size = struct.calcsize("iII")
    while True:
        try:
            data, anc, _, _ = sock.recvmsg(1, socket.CMSG_SPACE(size))
            break
        except BlockingIOError:
            fut = loop.create_future()
            loop.add_reader(sock.fileno(), fut.set_result, None)
            try:
                await fut
            finally:
                loop.remove_reader(sock.fileno())
    if not data:
        raise ForkServerError("the grading job closed its socket before starting")
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            pid, _, _ = struct.unpack("iII", payload[:size])
            return pid, data
    raise ForkServerError("no credentials on the grading job's socket")


async def _read_all(sock: socket.socket, timeout_s: float) -> bytes:
    loop = asyncio.get_running_loop()
    chunks = []
    with contextlib.suppress(TimeoutError, OSError):
        while chunk := await asyncio.wait_for(loop.sock_recv(sock, 1 << 16), timeout_s):
            chunks.append(chunk)
    return b"".join(chunks)[-2000:]
