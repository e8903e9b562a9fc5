"""The fork server itself: runs inside one long-lived sandbox and forks a fresh sandbox per
job (its host-side client is ``sandbox/forkserver_client.py``).

Starting bwrap and a Python interpreter costs a sandbox ~40 ms of CPU on a small machine, and
importing ``unittest`` for grading as much again: more than an episode's tool calls or a small
hidden test suite. This server pays for that once (it imports the supervisor, the test runner
and ``unittest``), then for each job forks a child that inherits the warm interpreter and
builds a sandbox of its own before any untrusted code runs:

- the child first reports to the host over the job's socket (the kernel attaches its host pid),
  and waits until the host has moved it into the job's own memory and pids cgroup;
- it then takes new mount, pid, network, IPC and UTS namespaces: the workspace as an overlay
  (an episode's own upper directory, or for grading a throwaway one over the final workspace
  with the hidden tests on top), fresh size-capped ``/tmp`` and ``/dev/shm``, its own
  ``/proc`` that shows only its processes, only a loopback interface, and the host's layer
  directory detached from its view;
- it enters a user namespace of its own as uid 1000 with no capabilities, no way back to them
  and no further user namespaces, and closes every descriptor but the job's socket.

The server forks each job straight into a fresh pid namespace (it unshares it, forks, and
returns to its own); the job takes its other fresh namespaces itself once it is in its
cgroup, before it builds its sandbox.
Pid 1 of a job's namespaces is its init; when it exits the kernel kills everything left
there, so nothing a job started survives it. A ``session`` job runs the episode supervisor
as that pid 1 (it reaps the orphans an init gets), a ``grade`` job the hidden tests.

Stdlib only (plus ``ctypes`` for the system calls Python does not wrap); the protocol with the
host is one JSON job per SOCK_SEQPACKET message on fd ``argv[1]``, carrying the job's socket
as SCM_RIGHTS.
"""

import _signal as signal  # the enum-free core: jobs touch fewer objects (pages copied)
import ctypes
import gc
import hashlib  # noqa: F401 - the test runner checks hidden files with it: loaded warm
import json  # also loaded warm for the supervisors (the test runner keeps its own codec)
import os
import resource
import socket
import struct
import sys

try:
    from . import runner, supervisor
    from .jsonlite import dumps
    from .lockdown import filter_program, install_filter, not_dumpable, own_keyring
    from .privileges import DEFAULT_LAST_CAP, drop_privileges, last_cap, warm
except ImportError:  # imported from the tools directory, not as a package
    import runner
    import supervisor
    from jsonlite import dumps
    from lockdown import filter_program, install_filter, not_dumpable, own_keyring
    from privileges import DEFAULT_LAST_CAP, drop_privileges, last_cap, warm

import unittest  # noqa: F401 - imported once here, inherited warm by every job

_OWN_MODULES = (
    "forkserver_server",
    "runner",
    "supervisor",
    "shell",
    "files",
    "capture",
    "integrity",
    "jsonlite",
    "canon",
    "lockdown",
    "privileges",
)

_LIBC = ctypes.CDLL(None, use_errno=True)
_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
_CLONE_NEWPID, _CLONE_NEWNET, _CLONE_NEWUSER = 0x20000000, 0x40000000, 0x10000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 1 << 14, 1 << 18
_MNT_DETACH = 2
_LAYERS = "/.layers"
# Looked up once here rather than in each job: a job's first use of a libc function or an
# array type builds objects (ctypes caches them on first use) after the fork, each on a page
# that the job then copies. main() also calls the harmless ones once for the same reason.
_mount_c, _umount2, _unshare, _setns = _LIBC.mount, _LIBC.umount2, _LIBC.unshare, _LIBC.setns
_prctl, _syscall = _LIBC.prctl, _LIBC.syscall  # called through _LIBC by lockdown, privileges
_socket_c, _ioctl = _LIBC.socket, _LIBC.ioctl
_SIOCSIFFLAGS = 0x8914
_LO_SOCKET = (int(socket.AF_INET), int(socket.SOCK_DGRAM | socket.SOCK_CLOEXEC), 0)
# struct ifreq (40 bytes): the name, then the flags IFF_UP | IFF_RUNNING
_IFREQ_LO_UP = struct.pack("16sH", b"lo", 0x1 | 0x40).ljust(40, b"\0")


_LAST_CAP = DEFAULT_LAST_CAP  # the highest capability this kernel knows: read by main(), once
_UID = 1000
_WS = "/workspace"


def _check(rc, what):
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data=None):
    _check(
        _mount_c(
            source.encode(),
            target.encode(),
            fstype.encode() if fstype else None,
            flags,
            data.encode() if data else None,
        ),
        f"mount {target}",
    )


def _esc(path):
    """Escape a layer path for overlayfs' comma/colon separated options."""
    return path.replace("\\", "\\\\").replace(":", "\\:").replace(",", "\\,")


def _setup_mounts(job):
    """Inside the job's new mount namespace: its workspace, scratch space and /proc."""
    _mount("none", "/", None, _MS_REC | _MS_PRIVATE)
    scratch = "/tmp"
    if job.get("upper"):  # an episode's own (size-capped, host-visible) upper directory
        upper, work = f"{_LAYERS}/{job['upper']}", f"{_LAYERS}/{job['work']}"
    else:  # grading: writes go to a throwaway tmpfs
        _mount("tmpfs", scratch, "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={int(job['disk'])}")
        upper, work = f"{scratch}/upper", f"{scratch}/work"
        os.mkdir(upper, 0o755)
        os.mkdir(work, 0o755)
    lowers = ":".join(_esc(f"{_LAYERS}/{p}") for p in job["lowers"])  # top layer first
    opts = f"lowerdir={lowers},upperdir={_esc(upper)},workdir={_esc(work)},userxattr"
    _mount("overlay", _WS, "overlay", _MS_NOSUID | _MS_NODEV, opts)
    # the overlay keeps its layers; the host's layer directory leaves this view entirely
    _check(_umount2(_LAYERS.encode(), _MNT_DETACH), f"umount {_LAYERS}")
    if not job.get("upper"):
        _check(_umount2(scratch.encode(), _MNT_DETACH), "detach the scratch tmpfs")
    tmp = f"size={int(job['tmp'])},mode=1777"
    _mount("tmpfs", "/tmp", "tmpfs", _MS_NOSUID | _MS_NODEV, tmp)
    _mount("tmpfs", "/dev/shm", "tmpfs", _MS_NOSUID | _MS_NODEV, tmp)
    if os.path.isdir("/dev/pts"):  # ptys of its own (/dev/ptmx links to pts/ptmx)
        pts = "newinstance,ptmxmode=0666,mode=620"
        _mount("devpts", "/dev/pts", "devpts", _MS_NOSUID | _MS_NOEXEC, pts)
    _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    for hidden in ("/proc/keys", "/proc/key-users"):  # the keyring is not namespaced
        _mount("/dev/null", hidden, None, _MS_BIND)


def _loopback_up():
    """The job's loopback interface up (SIOCSIFFLAGS), with libc calls prepared before the
    fork: a socket object and its class's machinery would be more pages copied per job."""
    fd = _socket_c(*_LO_SOCKET)
    if fd < 0:
        _check(-1, "socket for the loopback interface")
    try:
        _check(_ioctl(fd, _SIOCSIFFLAGS, _IFREQ_LO_UP), "bring the loopback interface up")
    finally:
        os.close(fd)


def _write(path, text):
    # one write(2), no file object: a job's every touched object is a page copied
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _become_agent():
    """A user namespace of the job's own, as uid/gid 1000 (the sandbox's user, mapped to
    the same host user as before), with no further user namespaces and no capabilities."""
    uid, gid = os.geteuid(), os.getegid()  # in the server's namespace, before leaving it
    _check(_unshare(_CLONE_NEWUSER), "unshare(CLONE_NEWUSER)")
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{_UID} {uid} 1")
    _write("/proc/self/gid_map", f"{_UID} {gid} 1")
    _write("/proc/sys/user/max_user_namespaces", "0")
    # /proc/sys is writable for our host uid until covered (as bwrap does): the cover is made
    # in a mount namespace owned by the new user namespace, so it cannot be undone from here
    _check(_unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    for sub in ("sys", "sysrq-trigger", "irq", "bus"):
        path = f"/proc/{sub}"
        if os.path.exists(path):
            _mount(path, path, None, _MS_BIND | _MS_REC)
            locked = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC  # kept: they are locked here
            _mount("none", path, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | locked)
    if os.getuid() != _UID or os.getgid() != _UID:
        raise OSError(0, f"expected uid {_UID}, got {os.getuid()}")


def _limits(job):
    for res, value in (
        (resource.RLIMIT_CPU, job.get("cpu")),
        (resource.RLIMIT_FSIZE, job.get("fsize")),
        (resource.RLIMIT_NOFILE, job.get("nofile")),
        (resource.RLIMIT_AS, job.get("as")),  # without cgroups (rootless) only
        (resource.RLIMIT_NPROC, job.get("nproc")),
    ):
        if value:
            resource.setrlimit(res, (int(value), int(value)))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _send(fd, data):
    """All of ``data`` to the job's socket with os.write: a socket object (and its class's
    machinery) would be more pages copied per job."""
    while data:
        data = data[os.write(fd, data) :]


def _fatal(fd, text):
    try:  # noqa: SIM105 - contextlib is a costly import here
        _send(fd, (dumps({"fatal": text}) + "\n").encode())
    except OSError:
        pass


def _close_fds_but(keep):
    os.closerange(3, keep)
    os.closerange(keep + 1, 65536)


def _run_grade(job, sock_fd):
    """Pid 1 of a grading job: run the tests in this (warm) interpreter."""
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    results = os.fdopen(os.dup(sock_fd), "w", buffering=1)
    os.close(sock_fd)
    _close_fds_but(results.fileno())
    spec = dict(job["spec"], workspace=_WS)
    try:
        runner.run(spec, results)
    except BaseException as e:  # the tests' own errors are reported per test; this is not
        results.write(dumps({"fatal": f"test runner failed: {type(e).__name__}: {e}"}) + "\n")
        results.flush()
        os._exit(71)
    results.flush()
    os._exit(0)


def _run_session(job, sock_fd):
    """Pid 1 of an episode is its supervisor, on the socket: no second fork of this
    interpreter. As init it cannot be killed from inside its namespace (signals it has no
    handler for are dropped there), it collects the orphans re-parented to it, and its exit
    ends every process the episode left."""
    try:
        os.dup2(sock_fd, 0)
        os.dup2(sock_fd, 1)
        null = os.open("/dev/null", os.O_WRONLY)
        os.dup2(null, 2)
        os.close(sock_fd)
        _close_fds_but(2)
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # no KeyboardInterrupt from `kill -INT 1`
        supervisor.serve(job["config"])
    finally:
        os._exit(0)


def _job_init(job, sock_fd):
    """Pid 1 of the job's namespaces: build its sandbox, then run the job."""
    try:
        _check(_unshare(_JOB_NS), "unshare the mount, network, IPC and UTS namespaces")
        _setup_mounts(job)
        _loopback_up()
        _become_agent()
        drop_privileges(_LAST_CAP, _LIBC)
        _limits(job)
        own_keyring(_CTYPES)
        if job.get("kind") == "session":
            not_dumpable(_CTYPES)
        install_filter(_FILTER[0], _CTYPES)
    except Exception as e:
        _fatal(sock_fd, f"sandbox setup failed: {type(e).__name__}: {e}")
        os._exit(70)
    for name in _OWN_MODULES:  # workspace modules may have these names
        sys.modules.pop(name, None)
    if job.get("kind") == "session":
        _run_session(job, sock_fd)
    else:
        _run_grade(job, sock_fd)


# A process cannot enter a new pid namespace itself, only its children can: the server makes
# each job's pid namespace and forks into it; the job makes its other namespaces itself
# (_job_init), so the server has one namespace to return to per job instead of five.
_JOB_NS = _CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWIPC | _CLONE_NEWUTS
_OWN_PID_NS = []  # the server's own pid namespace (an fd), to return to after each fork


def _fork_job():
    """Fork a child that is pid 1 of a fresh pid namespace (one fork per job, no
    intermediate process), then return to the server's own pid namespace."""
    if not _OWN_PID_NS:
        _OWN_PID_NS.append(os.open("/proc/self/ns/pid", os.O_RDONLY))
    _check(_unshare(_CLONE_NEWPID), "unshare(CLONE_NEWPID)")
    pid = -1
    try:
        pid = os.fork()
    finally:
        if pid != 0 and _setns(_OWN_PID_NS[0], _CLONE_NEWPID) != 0:
            os._exit(75)  # stuck in a job's namespace: the host starts a new server
    return pid


def _job(msg, fd):
    """The forked child, pid 1 of its namespaces: report to the host, wait to be placed in
    the job's cgroup, then read the job, build its sandbox and run the job. The job's
    decoded message is made here, not in the server: every object the server makes per job
    lands on pages it shares with its running jobs, each one copied again after every fork.
    The job's socket stays a bare descriptor (os.read and os.write) for the same reason."""
    try:
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        _send(fd, b"r")  # the host reads our pid from the socket's credentials
        if os.read(fd, 1) != b"g":
            os._exit(72)
        job = json.loads(msg)  # the C codec: less work, fewer pages touched
    except BaseException as e:
        _fatal(fd, f"job failed to start: {type(e).__name__}: {e}")
        os._exit(73)  # never back into the server's loop
    _job_init(job, fd)


def _job_fd(anc):
    """The descriptor passed with a job message (SCM_RIGHTS), or -1."""
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS and len(data) >= _FD_SIZE:
            return int.from_bytes(data[:_FD_SIZE], sys.byteorder)
    return -1


_FD_SIZE = 4  # one int
_ANC_SPACE = socket.CMSG_LEN(_FD_SIZE)  # room for one descriptor: more would be closed


_CTYPES = (ctypes, _LIBC)
_FILTER = []  # the seccomp filter every job installs (made by main())


def main():
    global _LAST_CAP
    ctl = socket.socket(fileno=int(sys.argv[1]))
    with open(f"{_LAYERS}/seccomp.bpf", "rb") as f:
        _FILTER.append(filter_program(f.read(), _CTYPES))
    _LAST_CAP = last_cap()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # jobs are reaped by the kernel
    warm(_LIBC)  # first calls and instances made here (see above)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # Everything imported so far goes to the permanent generation: jobs' garbage collections
    # then leave those objects' pages alone, so fewer pages are copied after each fork.
    gc.collect()
    gc.freeze()
    ctl.send(b"ready")
    while True:
        # as little as possible per job on this side (see _job): the message stays bytes and
        # the descriptor an int until the fork
        try:
            msg, anc, _, _ = ctl.recvmsg(1 << 20, _ANC_SPACE)
        except InterruptedError:
            continue
        if not msg:
            return
        fd = _job_fd(anc)
        if fd < 0:
            continue
        try:
            pid = _fork_job()
        except Exception as e:
            _fatal(fd, f"job was not started: {type(e).__name__}: {e}")
            os.close(fd)
            continue
        if pid == 0:
            ctl.close()
            _job(msg, fd)
        os.close(fd)


if __name__ == "__main__":
    main()
