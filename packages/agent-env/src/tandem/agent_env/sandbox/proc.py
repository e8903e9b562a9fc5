"""Child processes for the event loop without asyncio's child watcher.

asyncio's default watcher on Python 3.11 starts one thread per child blocked in waitpid and
races with ``subprocess``'s own reaping when transports are closed early ("Unknown child
process pid ..."). With hundreds of sandboxes alive, a pidfd per child registered with the
event loop is cheaper and exact: the loop learns of the exit and we reap it ourselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import subprocess
from typing import IO, Any

from tandem.agent_env.sandbox.cgroups import EpisodeCgroup

# Joins the cgroups before exec'ing bwrap, so that no process of the sandbox starts outside.
_JOIN = 'echo $$ > "$1" && echo $$ > "$2" && shift 2 && exec "$@"'
# The same, with the seccomp filter file opened as SECCOMP_FD for bwrap's ``--seccomp``.
SECCOMP_FD = 9
_JOIN_SECCOMP = (
    f'echo $$ > "$1" && echo $$ > "$2" && f="$3" && shift 3 && exec "$@" {SECCOMP_FD}<"$f"'
)
_STREAM_LIMIT = 8 << 20


_CLEAN_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}


class ChildProcess:
    """A subprocess with asyncio stdout/stderr readers, an optional stdin writer, and an
    awaitable exit status."""

    def __init__(self, popen: subprocess.Popen[bytes], loop: asyncio.AbstractEventLoop) -> None:
        self._popen = popen
        self._loop = loop
        self.pid = popen.pid
        self.returncode: int | None = None
        self._exited = asyncio.Event()
        self.stdin: asyncio.StreamWriter | None = None
        self.stdout: asyncio.StreamReader | None = None
        self.stderr: asyncio.StreamReader | None = None
        self._transports: list[asyncio.BaseTransport] = []
        self._pidfd = os.pidfd_open(self.pid)
        loop.add_reader(self._pidfd, self._on_exit)

    @classmethod
    async def start(
        cls,
        argv: list[str],
        *,
        stdin: bool = False,
        stderr: IO[bytes] | int | None = None,
        limit: int = 1 << 20,
        pass_fds: tuple[int, ...] = (),
    ) -> ChildProcess:
        loop = asyncio.get_running_loop()
        popen = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr if stderr is not None else subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
            pass_fds=pass_fds,
            env=_CLEAN_ENV,  # a sandbox's init keeps its initial environ readable in /proc
        )
        self = cls(popen, loop)
        try:
            self.stdout = await self._reader(popen.stdout, limit)
            if stderr == subprocess.PIPE:
                self.stderr = await self._reader(popen.stderr, limit)
            if stdin:
                transport, protocol = await loop.connect_write_pipe(
                    lambda: asyncio.streams.FlowControlMixin(loop=loop), popen.stdin
                )
                self._transports.append(transport)
                self.stdin = asyncio.StreamWriter(transport, protocol, None, loop)
        except BaseException:
            self.kill()
            raise
        return self

    async def _reader(self, pipe: IO[bytes] | None, limit: int) -> asyncio.StreamReader:
        reader = asyncio.StreamReader(limit=limit, loop=self._loop)
        transport, _ = await self._loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader, loop=self._loop), pipe
        )
        self._transports.append(transport)
        return reader

    def _on_exit(self) -> None:
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            pid, status = self.pid, 255 << 8
        if pid == 0:
            return
        self.returncode = os.waitstatus_to_exitcode(status)
        self._popen.returncode = self.returncode
        self._loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        self._exited.set()

    def has_exited(self) -> bool:
        """Whether the process has exited, even if the event loop has not noticed yet."""
        if self.returncode is not None:
            return True
        return bool(select.select([self._pidfd], [], [], 0)[0])

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    def abandon(self) -> None:
        """Kill and reap the process without its event loop (which may be closed already)
        and close our ends of its pipes."""
        self.kill()
        with contextlib.suppress(ChildProcessError, subprocess.TimeoutExpired):
            self._popen.wait(timeout=10)
        for t in self._transports:
            pipe = t.get_extra_info("pipe")
            with contextlib.suppress(Exception):
                t.close()
            with contextlib.suppress(Exception):
                pipe.close()
        self._transports = []
        if self.returncode is None:
            self.returncode = self._popen.returncode
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)

    def close(self) -> None:
        """Close our ends of the pipes (after the process is gone)."""
        for t in self._transports:
            t.close()
        self._transports = []


async def spawn(
    argv: list[str],
    cgroup: EpisodeCgroup | None,
    stderr: Any,
    stdin: bool = False,
    pass_fds: tuple[int, ...] = (),
    seccomp: str | None = None,
) -> ChildProcess:
    """Start ``argv`` inside the cgroup (via a tiny shell that joins it, then execs), with
    the seccomp filter file ``seccomp`` open as `SECCOMP_FD` when given."""
    files = cgroup.procs_files if cgroup is not None else []
    if not files and seccomp is not None:  # no cgroup to join (rootless): only the filter
        argv = [
            "/bin/sh",
            "-c",
            f'f="$1" && shift && exec "$@" {SECCOMP_FD}<"$f"',
            "sh",
            seccomp,
            *argv,
        ]
    elif files:
        if seccomp is not None:
            argv = ["/bin/sh", "-c", _JOIN_SECCOMP, "sh", files[0], files[-1], seccomp, *argv]
        else:
            argv = ["/bin/sh", "-c", _JOIN, "sh", files[0], files[-1], *argv]
    return await ChildProcess.start(
        argv, stdin=stdin, stderr=stderr, limit=_STREAM_LIMIT, pass_fds=pass_fds
    )


async def reap(proc: ChildProcess, cgroup: EpisodeCgroup | None, remove: bool = True) -> None:
    """Kill a sandbox and everything in it, and wait for it (and remove its cgroup)."""
    proc.kill()
    if cgroup is not None:
        await asyncio.to_thread(cgroup.remove if remove else cgroup.kill_all)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(proc.wait(), 10)
    proc.close()
