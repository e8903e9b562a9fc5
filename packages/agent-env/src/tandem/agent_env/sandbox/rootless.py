"""Limits for a user who is not root: a delegated cgroup v2 subtree, or rlimits.

The sandbox itself needs no privilege: user namespaces give it its own mounts, network,
processes and uid (``mounts.py`` makes the workspace helper's namespace a user namespace of
its own when not root). What a non-root user may lack is a place to make a memory and a pids
cgroup per sandbox. On cgroup v2, systemd delegates a subtree to each user (everything under
``user@UID.service`` belongs to that user), and a process started there (e.g. by
``systemd-run --user --scope``) can make its groups next to its own: `delegated_cgroup` finds
that place, and the limits are then the same as root's. Otherwise (cgroup v1, a login
session's scope, which is not delegated, or no memory or pids controller) limits fall back
to rlimits, which are weaker (see `WEAKER`): the sandbox's processes are bounded one by one,
not as a group.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import structlog

from tandem.agent_env.errors import SandboxError
from tandem.agent_env.sandbox.cgroups import CgroupManager, EpisodeCgroup

log = structlog.get_logger()

CGROUP_FS = Path("/sys/fs/cgroup")
_NEEDED = ("memory", "pids")

WEAKER = (
    "running without root and without a delegated cgroup: memory is capped per process "
    "(RLIMIT_AS), not per sandbox; the process limit (RLIMIT_NPROC) counts every process "
    "of this user in the sandbox's user namespace; OOM kills and refused forks are not "
    "reported; the workspace and /tmp size caps and everything else hold as with root"
)


def _writable_by(path: Path, uid: int) -> bool:
    """Whether ``uid`` may write ``path`` by its mode bits (delegation is by owner)."""
    try:
        st = path.stat()
    except OSError:
        return False
    return (st.st_uid == uid and bool(st.st_mode & 0o200)) or bool(st.st_mode & 0o002)


def _words(path: Path) -> set[str]:
    try:
        return set(path.read_text().split())
    except OSError:
        return set()


def delegated_cgroup(fs_root: Path, self_cgroup: str, uid: int) -> tuple[Path | None, str]:
    """The cgroup v2 directory under which user ``uid`` can make its sandboxes' groups, or
    None and why not. ``fs_root`` is where cgroupfs is mounted, ``self_cgroup`` the text of
    ``/proc/self/cgroup``.

    A group that holds processes (this process's own) cannot give children a memory or pids
    controller (cgroup v2's "no internal processes" rule), so the groups go next to it, under
    its parent (the root itself when this process is in the root group). That directory must
    be delegated to ``uid``: writable (to make groups), its ``cgroup.procs`` writable (moving a
    process between two groups needs write access to their common ancestor's), and memory and
    pids given to its children (``cgroup.subtree_control``), or at least offered to it
    (``cgroup.controllers``) with ``cgroup.subtree_control`` writable to enable them."""
    if not (fs_root / "cgroup.controllers").is_file():
        return None, f"{fs_root} is not a cgroup v2 (unified) hierarchy"
    own = next((ln[3:] for ln in self_cgroup.splitlines() if ln.startswith("0::")), None)
    if own is None:
        return None, "this process is in no cgroup v2 group (/proc/self/cgroup has no 0:: line)"
    mine = fs_root / own.strip().lstrip("/")
    base = mine.parent if mine != fs_root else fs_root
    for path in (base, base / "cgroup.procs"):
        if not _writable_by(path, uid):
            return None, f"{path} is not delegated to uid {uid} (not writable by it)"
    given = _words(base / "cgroup.subtree_control")
    offered = _words(base / "cgroup.controllers")
    for ctrl in _NEEDED:
        if ctrl in given:
            continue
        if ctrl not in offered:
            return None, f"the {ctrl} controller is not available in {base}"
        if not _writable_by(base / "cgroup.subtree_control", uid):
            return None, f"the {ctrl} controller is not enabled for {base}'s children"
    return base, ""


def rootless_cgroups(
    fs_root: Path = CGROUP_FS, self_cgroup: str | None = None, uid: int | None = None
) -> CgroupManager | RlimitManager:
    """Cgroups under a delegated subtree when there is one, else rlimits (logged with what is
    weaker and why there is no delegated subtree)."""
    if self_cgroup is None:
        self_cgroup = Path("/proc/self/cgroup").read_text()
    base, why = delegated_cgroup(fs_root, self_cgroup, os.geteuid() if uid is None else uid)
    if base is not None:
        try:
            manager = CgroupManager(str(base))
        except SandboxError as e:
            why = f"the delegated cgroup {base} could not be used: {e}"
        else:
            log.info("agent_env.rootless_cgroup", path=str(base))
            return manager
    log.warning("agent_env.rootless", weaker=WEAKER, why=why)
    return RlimitManager()


def rootless_limits(runtime: Any, limits: Any) -> dict[str, int]:
    """The rlimits that stand in for the cgroup limits (none when there are cgroups)."""
    if not getattr(runtime, "rootless", False):
        return {}
    return {"as": limits.memory_bytes, "nproc": limits.pids}


def rootless() -> bool:
    """Whether this process lacks the privileges the cgroup and mount setup needs."""
    return os.geteuid() != 0


class RlimitGroup(EpisodeCgroup):
    """Stands in for an episode's cgroup: nothing to join, count, kill or remove (a
    sandbox's processes end with its pid namespace's init)."""

    def __init__(self) -> None:
        super().__init__(0, {})

    @property
    def procs_files(self) -> list[str]:
        return []

    def oom_kills(self) -> int:
        return 0

    def pids_limit_hits(self) -> int:
        return 0

    def recycle(self) -> bool:
        return True

    def join(self, pid: int) -> None:
        pass

    def rmdir(self) -> bool:
        return True

    def pids(self) -> list[int]:
        return []

    def kill_all(self, timeout_s: float = 2.0) -> None:
        pass

    def remove(self) -> None:
        pass


class RlimitManager:
    """Stands in for `CgroupManager` (same methods): every group is an `RlimitGroup`."""

    version = 0
    parents: dict[str, Path] = {}  # noqa: RUF012 - never written

    def create(self, memory_bytes: int, pids: int, kind: str = "ep") -> EpisodeCgroup:
        return RlimitGroup()

    def idle_dirs(self) -> set[Path]:
        return set()

    def close(self) -> None:
        pass
