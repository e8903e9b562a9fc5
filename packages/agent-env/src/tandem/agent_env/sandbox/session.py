"""One running sandbox with its supervisor, and one-shot sandboxed runs (grading).

The episode's writes go to an overlay upper directory on its own size-capped tmpfs (see
``mounts``), outside the sandbox's lifetime, so the sandbox can be killed and restarted
without losing the workspace, and grading can stack that directory between the base and the
hidden tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import structlog

from tandem.agent_env.config import SandboxLimits
from tandem.agent_env.sandbox import bwrap as bw
from tandem.agent_env.sandbox import jsonwire
from tandem.agent_env.sandbox.cgroups import EpisodeCgroup
from tandem.agent_env.sandbox.deadlines import deadlines
from tandem.agent_env.sandbox.forkserver_client import ForkServerError, end_job, kill_job
from tandem.agent_env.sandbox.proc import ChildProcess, reap, spawn
from tandem.agent_env.sandbox.rootless import rootless_limits

if TYPE_CHECKING:
    from tandem.agent_env.sandbox.runtime import Runtime

log = structlog.get_logger()

_STREAM_LIMIT = 8 << 20
_decode = msgspec.json.Decoder(dict[str, Any]).decode  # answers are JSON objects, one a line


class SessionLost(Exception):
    """The supervisor died or stopped answering (killed by the command, or an infra fault)."""


class Session:
    """A supervisor serving tool requests for one episode; restartable, workspace kept."""

    def __init__(self, runtime: Runtime, base: Path, ep_dir: Path, limits: SandboxLimits) -> None:
        self.runtime = runtime
        self.base = base
        self.dir = ep_dir
        self.limits = limits
        self.disk = ep_dir / "disk"
        self.upper = self.disk / "upper"
        self._mounted = False
        self.workspace = ep_dir / "ws" if not runtime.sandboxed else Path(bw.WORKSPACE)
        self.proc: ChildProcess | None = None  # a sandbox of its own (bwrap) ...
        self.forked = False  # ... or a job of the runtime's fork server
        self._pidfd = -1  # the fork-server job's init (its supervisor)
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self.cgroup: EpisodeCgroup | None = None
        self.starts = 0
        self._released = False

    def _supervisor_config(self) -> dict[str, Any]:
        lim = self.limits
        return dict(
            {
                "workspace": str(self.workspace),
                "shell": self.runtime.config.shell,
                "timeout": lim.command_timeout_s,
                "head": lim.output_head_chars,
                "tail": lim.output_tail_chars,
                "max_stream": lim.max_output_bytes,
                "cpu": lim.cpu_seconds,
                "fsize": lim.file_size_bytes,
                "nofile": lim.open_files,
                "env": bw.sandbox_env(self.runtime.config),
                "pid_namespace": self.runtime.sandboxed,
                **rootless_limits(self.runtime, lim),
            }
        )

    async def _start_forked(self, work: Path) -> bool:
        """Start the supervisor as a job of the fork server; False if it cannot be used."""
        server = self.runtime.forkserver
        if server is None or self.cgroup is None:
            return False
        paths = [server.layer_path(p) for p in (self.base, self.upper, work)]
        if not all(paths):
            return False
        job = {
            "kind": "session",
            "lowers": [paths[0]],
            "upper": paths[1],
            "work": paths[2],
            "tmp": self.limits.tmp_bytes,
            "config": self._supervisor_config(),
        }
        try:
            sock, self._pidfd = await server.launch(job, self.cgroup)
        except ForkServerError as e:
            log.warning("agent_env.forkserver_session_failed", error=str(e))
            return False
        self._reader, self._writer = await asyncio.open_unix_connection(
            sock=sock, limit=_STREAM_LIMIT
        )
        self.forked = True
        try:
            hello = await self._read(30.0)
        except SessionLost as e:
            hello = {"fatal": str(e)}
        if hello.get("ready"):
            return True
        log.warning("agent_env.forkserver_session_failed", error=str(hello.get("fatal", hello)))
        await self.halt()
        return False

    async def _prepare(self, work: Path) -> None:
        """The episode's disk (mounted once, a fresh overlay work directory per start) and its
        cgroup (kept across restarts: files written stay charged). On the event loop: both are
        a few system calls here or in the mount helper, cheaper than a worker thread's trip."""
        rt, lim = self.runtime, self.limits
        assert rt.cgroups is not None and rt.mounts is not None
        if not self._mounted:
            await rt.mounts.call("mount", str(self.disk), lim.disk_bytes, (work.name,))
            self._mounted = True
        else:
            await rt.mounts.call("mkdir", str(work))
        if self.cgroup is None:
            mem = lim.memory_bytes + lim.disk_bytes + lim.tmp_bytes
            self.cgroup = rt.cgroups.create(mem, lim.pids)

    async def start(self) -> None:
        """Start (or restart) the sandbox; raises SessionLost if it does not come up."""
        self.starts += 1
        rt = self.runtime
        if rt.sandboxed:
            work = self.disk / f"work{self.starts}"
            await self._prepare(work)
            if await self._start_forked(work):
                return
            argv = rt.base_argv + bw.workspace_args([str(self.base)], str(self.upper), str(work))
            argv += bw.tool_argv(rt.config.python, "supervisor", bw.TOOLS_MOUNT)
        else:
            if not self.workspace.exists():
                await asyncio.to_thread(shutil.copytree, self.base, self.workspace, symlinks=True)
            argv = bw.tool_argv(sys.executable, "supervisor", str(bw.INSIDE_DIR))
        argv.append(json.dumps(self._supervisor_config()))
        errlog = open(self.dir / f"stderr{self.starts}", "wb")  # noqa: SIM115 - closed in stop()
        try:
            self.proc = await spawn(argv, self.cgroup, errlog, stdin=True, seccomp=rt.seccomp_file)
        finally:
            errlog.close()
        self._reader, self._writer = self.proc.stdout, self.proc.stdin
        await self._greeting()

    async def _greeting(self) -> None:
        try:
            hello = await self._read(30.0)
        except SessionLost as e:
            detail = self._stderr_tail()
            await self.halt()
            raise SessionLost(f"sandbox did not start: {e}; stderr: {detail}") from None
        if not hello.get("ready"):
            await self.halt()
            raise SessionLost(f"unexpected greeting from the supervisor: {hello}")

    def _stderr_tail(self) -> str:
        with contextlib.suppress(OSError):
            return (
                (self.dir / f"stderr{self.starts}").read_bytes()[-800:].decode("utf-8", "replace")
            )
        return ""

    async def _read(self, timeout: float) -> dict[str, Any]:
        reader = self._reader
        if reader is None:
            raise SessionLost("the sandbox is not running")
        watch = deadlines()  # no timer armed per call (see deadlines.py)
        watch.add(self, timeout, lambda: reader.set_exception(TimeoutError()))
        try:
            line = await reader.readline()
        except TimeoutError:
            raise SessionLost(f"no answer within {timeout:.0f} s") from None
        except (ValueError, asyncio.LimitOverrunError):
            raise SessionLost("oversized answer from the supervisor") from None
        finally:
            watch.discard(self)
        if not line:
            raise SessionLost("the supervisor exited")
        try:
            return _decode(line)
        except msgspec.DecodeError:
            raise SessionLost(f"garbled answer from the supervisor: {line[:200]!r}") from None

    async def request(self, req: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Send one request; SessionLost if the supervisor dies or hangs (it is then stopped)."""
        if self._writer is None:
            raise SessionLost("the sandbox is not running")
        try:
            self._writer.write(jsonwire.encode(req) + b"\n")
            await self._writer.drain()
            return await self._read(timeout)
        except (SessionLost, ConnectionError, BrokenPipeError) as e:
            await self.halt()
            raise SessionLost(str(e) or type(e).__name__) from None

    def oom_kills(self) -> int:
        return self.cgroup.oom_kills() if self.cgroup else 0

    def pids_limit_hits(self) -> int:
        return self.cgroup.pids_limit_hits() if self.cgroup else 0

    def _disconnect(self) -> int:
        """Forget the connection; the pidfd of a fork-server job's init, else -1."""
        forked, self.forked = self.forked, False
        if forked and self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None
        pidfd, self._pidfd = self._pidfd, -1
        return pidfd

    async def halt(self) -> None:
        """Kill the sandbox's processes but keep its cgroup (for a restart)."""
        pidfd = self._disconnect()
        if self.proc is not None:
            proc, self.proc = self.proc, None
            await reap(proc, self.cgroup, remove=False)
        elif pidfd >= 0 and not await kill_job(pidfd) and self.cgroup is not None:
            await asyncio.to_thread(self.cgroup.kill_all)

    async def stop(self) -> None:
        pidfd = self._disconnect()
        if self.proc is not None:
            proc, self.proc = self.proc, None
            await reap(proc, self.cgroup)
        elif self.cgroup is not None:
            if pidfd >= 0:
                await end_job(pidfd, self.cgroup)
            else:
                await asyncio.to_thread(self.cgroup.remove)
        elif pidfd >= 0:
            await kill_job(pidfd)
        self.cgroup = None

    async def discard(self) -> None:
        """Stop and delete the episode's files."""
        if self.proc is not None or self._pidfd >= 0:  # its processes go first
            await self.stop()
        self._disconnect()
        cgroup, self.cgroup = self.cgroup, None
        mounts = self.runtime.mounts if self._mounted else None
        self._mounted = False
        try:
            if cgroup is not None:  # what is left in it is killed (a thread: it may wait)
                await asyncio.to_thread(cgroup.remove)
            if mounts is not None:
                await mounts.call("umount", str(self.disk))
        finally:
            _remove_episode_dir(self.dir, self.disk)
            if not self._released:
                self._released = True
                self.runtime.release_base(self.base)

    def final_layers(self) -> list[str]:
        """The final workspace as overlay layers (bottom to top) or a plain directory."""
        if self.runtime.sandboxed:
            return [str(self.base), str(self.upper)]
        return [str(self.workspace)]


def _remove_episode_dir(path: Path, disk: Path) -> None:
    """Delete an episode's directory: usually just the (unmounted, empty) disk mount point,
    two rmdir calls instead of a tree walk; anything else (logs of a bwrap sandbox, a disk
    that could not be unmounted) goes through ``shutil.rmtree``."""
    try:
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(disk)
        os.rmdir(path)
    except OSError:
        shutil.rmtree(path, True)


def os_signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"
