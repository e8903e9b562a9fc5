"""Size-capped workspaces: one tmpfs per episode, mounted in a private mount namespace.

bwrap takes the overlay's upper directory from the host's file system, where nothing caps
how much an episode writes. So a small helper process (root, started once per runtime) lives
in its own mount namespace and mounts a size-capped tmpfs per episode there; sandboxes are
started inside that namespace (``nsenter``), so a full workspace fails with ENOSPC instead of
filling the host or the episode's memory. The helper dies with this process
(PR_SET_PDEATHSIG), which frees every mount at once; nothing is mounted in the host's own
namespace. The scratch root is a shared mount inside that namespace, so a sandbox started
there that binds it (the warm grader) sees workspaces mounted after it started.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import shutil
import subprocess
import threading

from tandem.agent_env.errors import SandboxError

_HELPER = r"""
import ctypes, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(1, 9)  # PR_SET_PDEATHSIG = SIGKILL
if os.getppid() != int(sys.argv[1]):
    sys.exit(3)
def check(rc, what):
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, "%s: %s" % (what, os.strerror(e)))
if sys.argv[3] == "userns":  # not root: a user namespace of our own, where we are root
    uid, gid = os.getuid(), os.getgid()
    check(libc.unshare(0x10000000 | 0x00020000), "unshare(CLONE_NEWUSER | CLONE_NEWNS)")
    for name, text in (("setgroups", "deny"), ("uid_map", "0 %d 1" % uid), ("gid_map", "0 %d 1" % gid)):
        with open("/proc/self/" + name, "w") as f:
            f.write(text)
else:
    check(libc.unshare(0x00020000), "unshare(CLONE_NEWNS)")
check(libc.mount(b"none", b"/", None, 0x4000 | (1 << 18), None), "make / private")
# the scratch root becomes a shared mount of this namespace only, so that workspaces mounted
# later also appear in sandboxes started here that bind it (the warm grader)
share = sys.argv[2].encode()
check(libc.mount(share, share, None, 4096, None), "bind the scratch root")
check(libc.mount(b"none", share, None, 1 << 20, None), "make the scratch root shared")
out = os.fdopen(os.dup(1), "w", buffering=1)
out.write('{"ok": true}\n')
for line in sys.stdin:
    req = json.loads(line)
    try:
        path = req["path"]
        if req["op"] == "mount":
            os.makedirs(path, exist_ok=True)
            opts = ("size=%d,mode=0755" % req["size"]).encode()
            check(libc.mount(b"tmpfs", path.encode(), b"tmpfs", 2 | 4, opts), "mount tmpfs")
            os.mkdir(os.path.join(path, "upper"))
            for d in req.get("dirs", []):
                os.mkdir(os.path.join(path, d))
        elif req["op"] == "mkdir":
            os.mkdir(path)
        elif req["op"] == "umount":
            check(libc.umount2(path.encode(), 2), "umount")
        out.write('{"ok": true}\n')
    except Exception as e:
        out.write(json.dumps({"ok": False, "error": "%s: %s" % (type(e).__name__, e)}) + "\n")
"""


class MountHelper:
    """Client of the helper process."""

    def __init__(self, python: str, share: str, userns: bool = False) -> None:
        self.userns = userns
        self.nsenter = shutil.which("nsenter") or ""
        if not self.nsenter:
            raise SandboxError(
                "`nsenter` (util-linux) was not found; it is needed to start sandboxes inside the "
                "private mount namespace that holds the size-capped workspaces (apt install util-linux)"
            )
        self._proc = subprocess.Popen(
            [
                python,
                "-I",
                "-S",
                "-c",
                _HELPER,
                str(os.getpid()),
                share,
                "userns" if userns else "-",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        hello = self._proc.stdout.readline() if self._proc.stdout else ""
        if not hello.startswith('{"ok": true}'):
            err = self._proc.stderr.read() if self._proc.stderr else ""
            self.close()
            raise SandboxError(
                f"could not create a private mount namespace for workspaces: {err.strip()[-400:]}. "
                "This needs root (CAP_SYS_ADMIN) on the host; or pass allow_unsandboxed=True"
            )
        self._lock = threading.Lock()
        self._out = self._proc.stdout.fileno()  # answers are read from it as bytes from now on
        os.set_blocking(self._out, False)
        self._buf = b""
        self._pending: collections.deque[asyncio.Future[dict]] = collections.deque()
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def ns_prefix(self) -> list[str]:
        """Command prefix that runs a program inside the helper's mount namespace."""
        ns = f"/proc/{self._proc.pid}/ns"
        if self.userns:  # join its user namespace first (as its root); setgroups is denied there
            return [
                self.nsenter,
                f"--user={ns}/user",
                f"--mount={ns}/mnt",
                "--preserve-credentials",
                "--",
            ]
        return [self.nsenter, f"--mount={ns}/mnt", "--"]

    def view(self, path: str) -> str:
        """``path`` as seen inside the helper's mount namespace (where the episodes' disks
        are mounted), reachable from this process through ``/proc/<helper>/root``."""
        return f"/proc/{self._proc.pid}/root{path}"

    async def call(self, op: str, path: str, size: int = 0, dirs: tuple[str, ...] = ()) -> None:
        """``mount`` (a tmpfs of ``size`` bytes with ``upper`` and ``dirs`` in it), ``mkdir``
        or ``umount``. Requests are pipelined and answered in order; the answers are read on
        the running event loop, so no worker thread is involved (a trip to one costs more
        CPU here than the request itself)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._attach(loop)
        answer = loop.create_future()
        req = {"op": op, "path": path, "size": size, "dirs": list(dirs)}
        with self._lock:
            assert self._proc.stdin is not None
            try:
                self._proc.stdin.write(json.dumps(req) + "\n")
                self._proc.stdin.flush()
            except OSError as e:
                raise SandboxError(f"the workspace mount helper died: {e}") from e
            self._pending.append(answer)
        resp = await answer
        if not resp.get("ok"):
            raise SandboxError(f"workspace mount helper: {op} {path}: {resp.get('error')}")

    def _attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read answers on ``loop`` (a runtime outlives the event loops that use it)."""
        old, self._loop = self._loop, loop
        if old is not None and not old.is_closed():
            old.remove_reader(self._out)
        loop.add_reader(self._out, self._on_readable)

    def _on_readable(self) -> None:
        try:
            chunk = os.read(self._out, 1 << 16)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:  # the helper is gone: every waiting request fails
            if self._loop is not None:
                self._loop.remove_reader(self._out)
            self._loop = None
            lost = {"ok": False, "error": "the workspace mount helper died"}
            while self._pending:
                self._answer(self._pending.popleft(), lost)
            return
        self._buf += chunk
        while b"\n" in self._buf and self._pending:
            line, _, self._buf = self._buf.partition(b"\n")
            self._answer(self._pending.popleft(), json.loads(line))

    @staticmethod
    def _answer(fut: asyncio.Future[dict], resp: dict) -> None:
        if not fut.done():
            with contextlib.suppress(RuntimeError):  # its event loop was closed meanwhile
                fut.set_result(resp)

    def close(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            with contextlib.suppress(Exception):  # (it may be another thread's loop)
                self._loop.remove_reader(self._out)
        self._loop = None
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        for f in (self._proc.stdin, self._proc.stdout, self._proc.stderr):
            if f is not None:
                f.close()
