"""Limits without cgroups, for a user who is not root and has no delegated cgroup.

The sandbox itself needs no privilege: user namespaces give it its own mounts, network,
processes and uid (``mounts.py`` makes the workspace helper's namespace a user namespace of
its own when not root). What a non-root user cannot do on cgroup v1 (or v2 without a
delegated subtree) is make a memory and a pids cgroup per sandbox, so limits fall back to
rlimits, which are weaker (see `WEAKER`): the sandbox's processes are bounded one by one,
not as a group.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tandem.agent_env.sandbox.cgroups import EpisodeCgroup

WEAKER = (
    "running without root and without a delegated cgroup: memory is capped per process "
    "(RLIMIT_AS), not per sandbox; the process limit (RLIMIT_NPROC) counts every process "
    "of this user in the sandbox's user namespace; OOM kills and refused forks are not "
    "reported; the workspace and /tmp size caps and everything else hold as with root"
)


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
