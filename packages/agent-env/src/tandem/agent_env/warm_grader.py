"""The warm grader: one long-lived grading sandbox per runtime that forks a sandbox per job.

A one-shot grading sandbox spends most of its CPU starting a Python interpreter and importing
``unittest`` (about 70 ms on a small machine), several times what a small hidden test suite
takes. The warm grader (``_sandbox/grader.py``) pays that once and forks a child per job that
still gets what a fresh sandbox gives: its own mount, pid, network, IPC and UTS namespaces, a
fresh copy-on-write view of the episode's final workspace with the hidden tests on top, fresh
``/tmp``, no capabilities, and its own memory and pids cgroup (this side moves it there before
it runs anything), all torn down when the job ends.

Each job talks to this process over its own socket pair (passed to the grader as SCM_RIGHTS),
so one job cannot see or forge another's results; the job's host pid comes from the socket's
credentials, which the kernel translates across pid namespaces.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import struct
from pathlib import Path
from typing import Any

import structlog

from tandem.agent_env import bwrap as bw
from tandem.agent_env.cgroups import EpisodeCgroup
from tandem.agent_env.proc import ChildProcess
from tandem.agent_env.session import reap, spawn

log = structlog.get_logger()

_START_TIMEOUT_S = 30.0
_HANDSHAKE_TIMEOUT_S = 30.0
_MAX_FAILURES = 3


class WarmGraderError(Exception):
    """The warm grader could not run a job (an infrastructure problem, not a test result)."""


class JobOutput:
    """What one grading job reported: its JSON lines, and whether it ended by itself."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.timed_out = False
        self.grader_died = False


class WarmGrader:
    """Client of the warm grading sandbox of one :class:`~tandem.agent_env.runtime.Runtime`."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self.proc: ChildProcess | None = None
        self.cgroup: EpisodeCgroup | None = None
        self.ctl: socket.socket | None = None
        self.starts = 0
        self.failures = 0  # consecutive failed starts; past _MAX_FAILURES it is not used
        self.disabled = ""  # why the warm grader is not used (then grading is one-shot)
        self._lock = asyncio.Lock()
        self._lock_loop: asyncio.AbstractEventLoop | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop that started proc

    def layer_path(self, path: Path | str) -> str | None:
        """A host layer's path as the grader sees it, or None if it cannot see it."""
        rel = os.path.relpath(os.path.realpath(path), os.path.realpath(self.runtime.root))
        if rel == "." or rel.startswith(("..", "/")):
            return None
        return rel

    def _locked(self) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        if self._lock_loop is not loop:  # a new asyncio.run(): locks belong to one loop
            self._lock, self._lock_loop = asyncio.Lock(), loop
        return self._lock

    async def _ensure(self) -> None:
        loop = asyncio.get_running_loop()
        if self.proc is not None and self._loop is not loop:
            self.abandon()  # started by an earlier event loop (asyncio.run again)
        elif self.proc is not None and self.proc.has_exited():
            await self._stop()
        if self.proc is not None:
            return
        if self.failures >= _MAX_FAILURES:
            raise WarmGraderError(
                f"the warm grader failed to start {self.failures} times; not restarting"
            )
        self.starts += 1
        rt = self.runtime
        lim = rt.config.limits
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        errlog_path = rt.root / f"grader-stderr{self.starts}"
        try:
            self.cgroup = await asyncio.to_thread(
                rt.cgroups.create, lim.memory_bytes + lim.tmp_bytes, lim.pids, "grader"
            )
            argv = [
                *rt.mounts.ns_prefix,
                *bw.grader_args(rt.bwrap, rt.config, rt.root / "etc", str(rt.root)),
            ]
            argv += bw.tool_argv(rt.config.python, "grader", bw.TOOLS_MOUNT)
            argv.append(str(theirs.fileno()))
            with open(errlog_path, "wb") as errlog:
                self.proc = await spawn(rt, argv, self.cgroup, errlog, pass_fds=(theirs.fileno(),))
            theirs.close()
            mine.setblocking(False)
            self.ctl = mine
            self._loop = loop
            hello = await asyncio.wait_for(loop.sock_recv(mine, 64), _START_TIMEOUT_S)
            if hello != b"ready":
                raise WarmGraderError(f"unexpected greeting {hello!r}")
        except BaseException as e:
            theirs.close()
            self.failures += 1
            await self._stop()
            detail = ""
            with contextlib.suppress(OSError):
                detail = errlog_path.read_bytes()[-800:].decode("utf-8", "replace")
            if isinstance(e, Exception):
                raise WarmGraderError(f"the warm grader did not start: {e!r}; {detail}") from e
            raise
        self.failures = 0
        log.info("agent_env.warm_grader_started", pid=self.proc.pid if self.proc else None)

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
        """Stop the grader without an event loop (the one that started it may be closed)."""
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

    async def run(self, lowers: list[str], spec: dict[str, Any], timeout_s: float) -> JobOutput:
        """Run one job over ``lowers`` (grader-side layer paths, top first); raises
        :class:`WarmGraderError` when the job could not be started."""
        async with self._locked():
            await self._ensure()
            assert self.ctl is not None and self.proc is not None
            ctl, proc = self.ctl, self.proc
        rt = self.runtime
        lim = rt.config.limits
        job = {
            "lowers": lowers,
            "spec": spec,
            "disk": lim.disk_bytes,
            "tmp": lim.tmp_bytes,
            "cpu": lim.cpu_seconds,
            "fsize": lim.file_size_bytes,
            "nofile": lim.open_files,
        }
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        mine.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        mine.setblocking(False)
        cgroup: EpisodeCgroup | None = None
        out = JobOutput()
        try:
            try:
                socket.send_fds(ctl, [json.dumps(job).encode()], [theirs.fileno()])
            except OSError as e:
                raise WarmGraderError(f"could not send the job to the warm grader: {e}") from e
            finally:
                theirs.close()
            pid, first = await asyncio.wait_for(_recv_creds(mine), _HANDSHAKE_TIMEOUT_S)
            if first != b"r":  # the grader reports why it could not start the job
                rest = await _read_all(mine, 5.0)
                raise WarmGraderError(
                    "grading job did not start: " + (first + rest).decode("utf-8", "replace")
                )
            mem = lim.memory_bytes + lim.disk_bytes + lim.tmp_bytes
            cgroup = rt.cgroups.create(mem, lim.pids)
            try:
                for f in cgroup.procs_files:
                    Path(f).write_text(str(pid))
            except OSError as e:
                msg = f"could not move grading job {pid} into its cgroup: {e}"
                raise WarmGraderError(msg) from e
            await asyncio.get_running_loop().sock_sendall(mine, b"g")
            reader, writer = await asyncio.open_unix_connection(sock=mine, limit=1 << 22)
            try:
                await asyncio.wait_for(_read_lines(reader, out), timeout_s)
            except TimeoutError:
                out.timed_out = True
            finally:
                writer.close()
            out.grader_died = proc.has_exited()
            return out
        except (TimeoutError, ConnectionError) as e:
            raise WarmGraderError(f"grading job handshake failed: {e!r}") from e
        finally:
            mine.close()
            if cgroup is not None:
                await asyncio.to_thread(cgroup.remove)


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
        raise WarmGraderError("the grading job closed its socket before starting")
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            pid, _, _ = struct.unpack("iII", payload[:size])
            return pid, data
    raise WarmGraderError("no credentials on the grading job's socket")


async def _read_all(sock: socket.socket, timeout_s: float) -> bytes:
    loop = asyncio.get_running_loop()
    chunks = []
    with contextlib.suppress(TimeoutError, OSError):
        while chunk := await asyncio.wait_for(loop.sock_recv(sock, 1 << 16), timeout_s):
            chunks.append(chunk)
    return b"".join(chunks)[-2000:]


async def _read_lines(reader: asyncio.StreamReader, out: JobOutput) -> None:
    while True:
        try:
            line = await reader.readline()
        except (ValueError, asyncio.LimitOverrunError):  # an oversized line: skip it
            continue
        if not line:
            return
        with contextlib.suppress(ValueError):
            msg = json.loads(line)
            if isinstance(msg, dict):
                out.messages.append(msg)
