"""Process-wide sandbox resources: bwrap, cgroups, scratch space and per-task base layers.

A task's repository is materialised once as a read-only base layer and shared by every
episode of that task (a GRPO group runs many episodes of one task); each episode only gets an
empty upper directory for its own writes, so starting an episode costs an overlay mount
instead of a copy.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import hashlib
import os
import shutil
import sys
import tarfile
import tempfile
import threading
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import ClassVar

import msgspec
import structlog

from tandem.agent_env.config import SandboxConfig
from tandem.agent_env.errors import SandboxError
from tandem.agent_env.sandbox import bwrap as bw
from tandem.agent_env.sandbox.cgroups import CgroupManager
from tandem.agent_env.sandbox.forkserver_client import ForkServer
from tandem.agent_env.sandbox.locales import build_locale_dir, covered_by
from tandem.agent_env.sandbox.mounts import MountHelper
from tandem.agent_env.sandbox.proc import SECCOMP_FD
from tandem.agent_env.sandbox.rootless import RlimitManager, rootless, rootless_cgroups
from tandem.agent_env.sandbox.seccomp import write_filter
from tandem.agent_env.task import Task

log = structlog.get_logger()


def _safe_rel(path: str) -> str:
    rel = os.path.normpath(path)
    if os.path.isabs(rel) or rel == ".." or rel.startswith("../") or rel == ".":
        raise SandboxError(f"task file path {path!r} must be relative and inside the repository")
    return rel


def write_tree(root: Path, files: dict[str, str]) -> None:
    for path, content in files.items():
        dest = root / _safe_rel(path)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(content)


class Runtime:
    """Shared by all episodes of one process (and one sandbox config)."""

    _shared: ClassVar[dict[tuple[bytes, bool], Runtime]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, config: SandboxConfig, sandboxed: bool = True) -> None:
        self.config = config
        self.sandboxed = sandboxed
        root = config.work_root or (
            "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        )
        _sweep_stale(Path(root))
        self.root = Path(tempfile.mkdtemp(prefix=f"tandem-agent-env-{os.getpid()}-", dir=root))
        self._bases: OrderedDict[str, Path] = OrderedDict()
        self._refs: dict[Path, int] = {}
        self._built: set[str] = set()  # digests of the bases built under root/bases
        self.max_cached_bases = 512
        self._episodes = 0
        self.cgroups: CgroupManager | RlimitManager | None = None
        self.rootless = False  # True when rlimits stand in for cgroups (rootless.py)
        self.mounts: MountHelper | None = None
        self._forkservers: dict[asyncio.AbstractEventLoop, ForkServer] = {}
        self._servers_lock = threading.Lock()
        self.bwrap = ""
        self.locale_dir: Path | None = None  # a locale archive for sandboxes (locales.py)
        self.seccomp_file: str | None = None  # the filter every sandbox runs under
        try:
            if sandboxed:
                self.bwrap = bw.find_bwrap(config.bwrap)
                bw.probe(self.bwrap, config.python, str(self.root))
                if rootless() and not config.cgroup_root:
                    self.cgroups = rootless_cgroups()
                else:
                    self.cgroups = CgroupManager(config.cgroup_root)
                self.rootless = isinstance(self.cgroups, RlimitManager)
                self.mounts = MountHelper(sys.executable, str(self.root), userns=rootless())
            bw.write_etc(self.root / "etc")
            if sandboxed:  # in the scratch root: the fork server reads it at /.layers
                self.seccomp_file = write_filter(str(self.root / "seccomp.bpf"))
            if sandboxed and covered_by(config.system_dirs):
                self.locale_dir = build_locale_dir(self.root / "locale")
            bw.precompile(config.python if sandboxed else sys.executable)
        except BaseException:
            self.close()
            raise
        self.base_argv = (
            [
                *self.mounts.ns_prefix,
                *bw.base_args(
                    self.bwrap,
                    config,
                    self.root / "etc",
                    locale_dir=self.locale_dir,
                    seccomp_fd=SECCOMP_FD,
                ),
            ]
            if self.mounts is not None
            else []
        )
        atexit.register(self.close)

    @property
    def forkserver(self) -> ForkServer | None:
        """The fork server of the running event loop (one per loop: its pipes and child
        watch belong to it), or None when this runtime starts a bwrap sandbox per job.
        Servers of loops that have been closed are stopped here."""
        if not (self.sandboxed and self.config.fork_server) or self.root is None:
            return None
        loop = asyncio.get_running_loop()
        with self._servers_lock:
            stale = [self._forkservers.pop(lp) for lp in list(self._forkservers) if lp.is_closed()]
            server = self._forkservers.get(loop)
            if server is None:
                server = self._forkservers[loop] = ForkServer(self)
        for old in stale:
            old.abandon()
        return server

    @classmethod
    def shared(cls, config: SandboxConfig, sandboxed: bool = True) -> Runtime:
        """One runtime per (config, mode) per process, created on first use."""
        key = (msgspec.json.encode(config), sandboxed)
        with cls._lock:
            rt = cls._shared.get(key)
            if rt is None or rt.root is None:
                rt = cls._shared[key] = cls(config, sandboxed)
            return rt

    def acquire_base(self, task: Task) -> Path:
        """The read-only base layer with the task's repository, built once per task and
        shared by its episodes; pair with :meth:`release_base`."""
        digest = hashlib.sha256(
            msgspec.json.encode([task.id, task.files, task.repo_path])
        ).hexdigest()[:16]
        path = self._bases.get(digest)
        if path is None:
            path = self._build_base(task, digest)
            self._bases[digest] = path
            if path.parent == self.root / "bases":  # not a directory used in place
                self._built.add(digest)
        self._bases.move_to_end(digest)
        self._refs[path] = self._refs.get(path, 0) + 1
        return path

    def release_base(self, path: Path) -> None:
        """An episode is done with a base; evict unused bases beyond ``max_cached_bases``."""
        self._refs[path] = self._refs.get(path, 1) - 1
        excess = len(self._built) - self.max_cached_bases
        if excess <= 0:  # the common case: no scan of the cache per episode
            return
        for digest in [d for d in self._bases if d in self._built]:  # least recently used first
            if excess <= 0:
                break
            p = self._bases[digest]
            if self._refs.get(p, 0) <= 0:
                del self._bases[digest]
                self._built.discard(digest)
                self._refs.pop(p, None)
                shutil.rmtree(p, ignore_errors=True)
                excess -= 1

    def _build_base(self, task: Task, digest: str) -> Path:
        if task.repo_path and os.path.isdir(task.repo_path) and not task.files:
            return Path(task.repo_path).resolve()  # used in place, read-only
        dest = self.root / "bases" / digest
        tmp = self.root / "bases" / f".{digest}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        if task.repo_path:
            _extract(Path(task.repo_path), tmp)
        write_tree(tmp, task.files)
        tmp.rename(dest)
        return dest

    def hidden_layer(self, task: Task, base: Path, into: Path) -> Path:
        """Top layer for grading: hidden test files plus pristine copies of ``reset_paths``."""
        into.mkdir(parents=True, exist_ok=True)
        for rel in task.hidden_tests.reset_paths:
            src = base / _safe_rel(rel)
            dst = into / _safe_rel(rel)
            if src.is_dir():
                shutil.copytree(src, dst, dirs_exist_ok=True, symlinks=True)
            elif src.exists():
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst, follow_symlinks=False)
        write_tree(into, task.hidden_tests.files)
        return into

    def episode_dir(self) -> Path:
        self._episodes += 1
        d = self.root / "episodes" / str(self._episodes)
        d.mkdir(parents=True)
        return d

    def close(self) -> None:
        with self._servers_lock:
            servers, self._forkservers = list(self._forkservers.values()), {}
        for server in servers:
            server.abandon()
        if self.mounts is not None:
            self.mounts.close()
            self.mounts = None
        if self.cgroups is not None:
            self.cgroups.close()
            self.cgroups = None
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None  # type: ignore[assignment]
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)


def _sweep_stale(root: Path) -> None:
    """Delete scratch directories left by processes of this package that no longer exist."""
    for d in root.glob("tandem-agent-env-*-*"):
        pid = d.name.split("-")[3]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(d, ignore_errors=True)


def _extract(archive: Path, dest: Path) -> None:
    """Unpack a repository archive, refusing members that would land outside ``dest``."""
    name = archive.name
    if not archive.is_file():
        raise SandboxError(
            f"repository snapshot {archive} is neither a directory nor an archive file"
        )
    if name.endswith(".zip"):
        with zipfile.ZipFile(archive) as zf:
            for member in zf.namelist():
                _safe_rel(member.rstrip("/") or ".x")
            zf.extractall(dest)
    elif name.endswith((".tar", ".tar.gz", ".tgz", ".tar.xz", ".tar.bz2")):
        with tarfile.open(archive) as tf:
            tf.extractall(dest, filter="data")
    else:
        raise SandboxError(
            f"unsupported repository archive {archive}: use .tar, .tar.gz, .tgz or .zip"
        )
    entries = list(dest.iterdir())
    if len(entries) == 1 and entries[0].is_dir():  # strip a single top-level folder
        inner = entries[0].rename(dest / ".tandem-strip")
        for child in list(inner.iterdir()):
            child.rename(dest / child.name)
        inner.rmdir()
