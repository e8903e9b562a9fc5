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
    """Client of the helper process; one request at a time."""

    def __init__(self, python: str, share: str) -> None:
        self.nsenter = shutil.which("nsenter") or ""
        if not self.nsenter:
            raise SandboxError(
                "`nsenter` (util-linux) was not found; it is needed to start sandboxes inside the "
                "private mount namespace that holds the size-capped workspaces (apt install util-linux)"
            )
        self._proc = subprocess.Popen(
            [python, "-I", "-S", "-c", _HELPER, str(os.getpid()), share],
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

    @property
    def ns_prefix(self) -> list[str]:
        """Command prefix that runs a program inside the helper's mount namespace."""
        return [self.nsenter, f"--mount=/proc/{self._proc.pid}/ns/mnt", "--"]

    def _call(self, req: dict) -> None:
        with self._lock:
            self._call_locked(req)

    def _call_locked(self, req: dict) -> None:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(json.dumps(req) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise SandboxError("the workspace mount helper died")
        resp = json.loads(line)
        if not resp.get("ok"):
            raise SandboxError(
                f"workspace mount helper: {req['op']} {req['path']}: {resp.get('error')}"
            )

    def call_sync(self, op: str, path: str, size: int = 0, dirs: tuple[str, ...] = ()) -> None:
        """``mount`` (a tmpfs of ``size`` bytes with ``upper`` and ``dirs`` in it), ``mkdir``
        or ``umount``; one round trip each. Blocks: call it from a worker thread."""
        self._call({"op": op, "path": path, "size": size, "dirs": list(dirs)})

    async def call(self, op: str, path: str, size: int = 0, dirs: tuple[str, ...] = ()) -> None:
        """:meth:`call_sync` in a worker thread."""
        await asyncio.to_thread(self.call_sync, op, path, size, dirs)

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        for f in (self._proc.stdin, self._proc.stdout, self._proc.stderr):
            if f is not None:
                f.close()
