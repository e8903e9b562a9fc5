"""Per-episode cgroups for memory and process limits, on cgroup v1 or v2.

rlimits cannot stop a fork bomb run by root-in-a-user-namespace, and they count per process,
not per sandbox: a pids cgroup and a memory cgroup per episode can. Each process of tandem
gets one parent group per hierarchy (``tandem-agent-env-<pid>-<tag>``) and one child per episode;
both are removed on close, and parents left by a dead process are swept on start.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import time
from pathlib import Path

import structlog

from tandem.agent_env.errors import SandboxError

log = structlog.get_logger()

_PREFIX = "tandem-agent-env-"
_FIX = (
    "Run as root (or with a delegated cgroup: on cgroup v2, e.g. `systemd-run --scope -p "
    "Delegate=yes ...`, and pass SandboxConfig(cgroup_root=<that cgroup's directory>)), or "
    "pass allow_unsandboxed=True to run without isolation."
)


def _mounts() -> list[tuple[str, str, set[str]]]:
    out = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[2] in ("cgroup", "cgroup2"):
            out.append((parts[1], parts[2], set(parts[3].split(","))))
    return out


def _own_paths() -> dict[str, str]:
    """Controller (or '' for v2) -> this process's cgroup path."""
    paths: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, ctrls, path = line.split(":", 2)
        for c in ctrls.split(",") if ctrls else [""]:
            paths[c] = path
    return paths


def _read_counter(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == key:
                return int(v)
    except (OSError, ValueError):
        pass
    return 0


IDLE_GROUPS = 256  # emptied episode groups a manager keeps for reuse, per set of limits
_WRITE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC  # Path.write_text's flags


def _write(path: Path, text: str) -> None:
    """One open and write(2), without a file object: cgroup files are written at every
    episode start, on the host's event loop."""
    fd = os.open(path, _WRITE, 0o644)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _rmdir_retry(path: Path, deadline_s: float = 2.0) -> bool:
    end = time.monotonic() + deadline_s
    while True:
        try:
            path.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if time.monotonic() > end:
                return False
            time.sleep(0.005)


class EpisodeCgroup:
    """The cgroup(s) of one sandbox: join files, limit counters, kill, remove."""

    def __init__(
        self, version: int, dirs: dict[str, Path], idle: list[EpisodeCgroup] | None = None
    ) -> None:
        self.version = version
        self.dirs = dirs  # controller -> directory ("" for v2)
        self._idle = idle  # the manager's emptied groups with these limits (see recycle)
        self._base = (0, 0)  # the counters when the group last went back to the manager

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs.values()]

    def _oom_total(self) -> int:
        if self.version == 2:
            return _read_counter(self.dirs[""] / "memory.events", "oom_kill")
        return _read_counter(self.dirs["memory"] / "memory.oom_control", "oom_kill")

    def _pids_total(self) -> int:
        d = self.dirs[""] if self.version == 2 else self.dirs["pids"]
        return _read_counter(d / "pids.events", "max")

    def oom_kills(self) -> int:
        """OOM kills in this group since the current sandbox got it."""
        return self._oom_total() - self._base[0]

    def pids_limit_hits(self) -> int:
        """Forks refused at the pids limit since the current sandbox got the group."""
        return self._pids_total() - self._base[1]

    def recycle(self) -> bool:
        """Hand back a group whose processes are gone: it is kept, emptied and with the same
        limits, for the manager's next :meth:`CgroupManager.create` (making and removing a
        memory and a pids group costs ~0.5 ms of CPU here and more in kernel workers), or
        removed once enough are kept. False if it still has processes."""
        if self._idle is None or len(self._idle) >= IDLE_GROUPS or not self._empty():
            return self.rmdir()
        self._base = (self._oom_total(), self._pids_total())
        self._idle.append(self)
        return True

    def _empty(self) -> bool:
        for d in self.dirs.values():
            try:
                with open(d / "cgroup.procs", "rb") as f:
                    if f.read(16).strip():
                        return False
            except OSError:
                return False
        return True

    def join(self, pid: int) -> None:
        """Move process ``pid`` into this group (every hierarchy)."""
        for d in self.dirs.values():
            _write(d / "cgroup.procs", str(pid))

    def rmdir(self) -> bool:
        """Remove the (empty) group at once; False if it still has processes."""
        for d in self.dirs.values():
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                return False
        return True

    def pids(self) -> list[int]:
        d = next(iter(self.dirs.values()))
        try:
            return [int(p) for p in (d / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def kill_all(self, timeout_s: float = 2.0) -> None:
        """SIGKILL every process in the group until it is empty (forks race the kill)."""
        if self.version == 2:
            with contextlib.suppress(OSError):
                (self.dirs[""] / "cgroup.kill").write_text("1")
        end = time.monotonic() + timeout_s
        while pids := self.pids():
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            if time.monotonic() > end:
                log.warning("cgroup.kill_incomplete", left=len(pids))
                return
            time.sleep(0.002)

    def remove(self) -> None:
        self.kill_all()
        for d in self.dirs.values():
            if not _rmdir_retry(d):
                log.warning("cgroup.remove_failed", path=str(d))


class CgroupManager:
    """Creates episode cgroups under a per-process parent in each needed hierarchy."""

    def __init__(self, cgroup_root: str = "") -> None:
        self._tag = secrets.token_hex(4)  # several managers may live in one process
        self.version, bases = self._discover(cgroup_root)
        self._sweep(bases)
        self.parents: dict[str, Path] = {}
        try:
            if self.version == 2:  # a delegated root may not give its children them yet
                self._enable_v2(bases[""])
            for ctrl, base in bases.items():
                parent = base / f"{_PREFIX}{os.getpid()}-{self._tag}"
                parent.mkdir(exist_ok=True)
                self.parents[ctrl] = parent
            if self.version == 2:
                self._enable_v2(self.parents[""])
        except OSError as e:
            self.close()
            raise SandboxError(
                f"cannot create cgroups under {list(bases.values())}: {e}. {_FIX}"
            ) from e
        self._count = 0
        self._memsw = True  # cgroup v1 without swap accounting has no memsw files
        # emptied episode groups by (memory, pids) limits, reused before new ones are made
        self._idle: dict[tuple[int, int], list[EpisodeCgroup]] = {}

    @staticmethod
    def _discover(cgroup_root: str) -> tuple[int, dict[str, Path]]:
        mounts = _mounts()
        own = _own_paths()
        if cgroup_root:
            root = Path(cgroup_root)
            if (root / "cgroup.controllers").exists():
                return 2, {"": root}
            raise SandboxError(f"cgroup_root {root} is not a cgroup v2 directory. {_FIX}")
        v1: dict[str, Path] = {}
        for mnt, fstype, opts in mounts:
            for ctrl in ("pids", "memory"):
                if fstype == "cgroup" and ctrl in opts:
                    sub = own.get(ctrl, "/").lstrip("/")
                    cand = Path(mnt) / sub
                    v1[ctrl] = cand if cand.is_dir() else Path(mnt)
        if len(v1) == 2:
            return 1, v1
        for mnt, fstype, _ in mounts:
            if fstype == "cgroup2":
                ctrls = set((Path(mnt) / "cgroup.controllers").read_text().split())
                if {"pids", "memory"} <= ctrls:
                    sub = own.get("", "/").lstrip("/")
                    return 2, {"": (Path(mnt) / sub).parent if sub else Path(mnt)}
        raise SandboxError(
            "no usable cgroup hierarchy with the 'pids' and 'memory' controllers was found "
            f"(mounts: {[(m, t) for m, t, _ in mounts]}); they are needed to bound a sandbox's "
            f"processes and memory. {_FIX}"
        )

    @staticmethod
    def _enable_v2(parent: Path) -> None:
        wanted = {"pids", "memory"}
        ctl = parent / "cgroup.subtree_control"
        have = set(ctl.read_text().split()) if ctl.exists() else set()
        if not wanted <= have:
            ctl.write_text(" ".join(f"+{c}" for c in sorted(wanted)))

    @staticmethod
    def _sweep(bases: dict[str, Path]) -> None:
        """Remove empty parents left behind by processes that no longer exist."""
        for base in bases.values():
            with contextlib.suppress(OSError):
                for d in base.glob(f"{_PREFIX}*"):
                    pid = d.name.removeprefix(_PREFIX).split("-")[0]
                    if not pid.isdigit() or Path(f"/proc/{pid}").exists():
                        continue
                    for child in d.iterdir():
                        if child.is_dir():
                            EpisodeCgroup(0, {"x": child}).kill_all(0.5)
                            _rmdir_retry(child, 0.5)
                    _rmdir_retry(d, 0.5)

    def create(self, memory_bytes: int, pids: int, kind: str = "ep") -> EpisodeCgroup:
        """A child group ``<kind>-<n>`` with these limits (``ep`` for episodes and grading
        jobs, ``forkserver`` for the fork server). An episode group that an earlier sandbox
        emptied and recycled (same limits, no processes, counters counted from now on) is
        taken before a new one is made."""
        idle = self._idle.setdefault((memory_bytes, pids), []) if kind == "ep" else None
        if idle:
            with contextlib.suppress(IndexError):  # taken meanwhile by a worker thread's call
                return idle.pop()
        self._count += 1
        name = f"{kind}-{self._count}"
        dirs: dict[str, Path] = {}
        try:
            for ctrl, parent in self.parents.items():
                d = parent / name
                os.mkdir(d)
                dirs[ctrl] = d
            mem, swap = (
                (dirs[""] / "memory.max", dirs[""] / "memory.swap.max")
                if self.version == 2
                else (dirs["memory"] / "memory.limit_in_bytes", None)
            )
            _write(mem, str(memory_bytes))
            if swap is not None:
                with contextlib.suppress(OSError):
                    _write(swap, "0")
            elif self._memsw:
                try:
                    _write(dirs["memory"] / "memory.memsw.limit_in_bytes", str(memory_bytes))
                except OSError:
                    self._memsw = False  # not tried again: it fails the same way every time
            _write((dirs[""] if self.version == 2 else dirs["pids"]) / "pids.max", str(pids))
        except OSError as e:
            EpisodeCgroup(self.version, dirs).remove()
            raise SandboxError(f"cannot set up the episode cgroup {name}: {e}. {_FIX}") from e
        return EpisodeCgroup(self.version, dirs, idle)

    def idle_dirs(self) -> set[Path]:
        """Directories of the emptied groups kept for reuse (see EpisodeCgroup.recycle)."""
        return {d for idle in self._idle.values() for cg in idle for d in cg.dirs.values()}

    def close(self) -> None:
        self._idle = {}
        for parent in self.parents.values():
            for child in [d for d in parent.glob("*") if d.is_dir()]:
                EpisodeCgroup(self.version, {"x": child}).kill_all(0.5)
                _rmdir_retry(child, 0.5)
            _rmdir_retry(parent, 0.5)
        self.parents = {}
