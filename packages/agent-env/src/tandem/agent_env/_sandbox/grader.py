"""Warm grading server: runs inside a long-lived sandbox, forks one isolated job per grading.

Starting a fresh interpreter and importing ``unittest`` costs more than most hidden test suites
take to run. This server pays that once: it imports the test runner and ``unittest``, then for
each job forks a child that inherits the warm interpreter and builds a sandbox of its own
before any test code runs:

- the child first reports to the host over the job's socket (the kernel attaches its host pid),
  and waits until the host has moved it into the job's own memory and pids cgroup;
- it then takes new mount, pid, network, IPC and UTS namespaces: a fresh overlay of the
  episode's final workspace with the hidden tests on top and a size-capped tmpfs for writes,
  fresh ``/tmp`` and ``/dev/shm``, its own ``/proc`` that shows only its processes, only a
  loopback interface, and the host's layer directory detached from its view;
- it drops every capability (bounding set, ambient set, securebits locked, no user
  namespaces) and closes every descriptor but the job's socket, then runs the tests.

When the job's first process exits, the kernel kills everything left in its pid namespace, so
nothing a job started survives into the next one; what a job wrote lived in its own tmpfs.

Stdlib only (plus ``ctypes`` for the system calls Python does not wrap); the protocol with the
host is one JSON job spec per SOCK_SEQPACKET message on fd ``argv[1]``, carrying the job's
socket as SCM_RIGHTS.
"""

import ctypes
import os
import resource
import signal
import socket
import struct
import sys

try:
    from . import runner
    from .jsonlite import dumps, loads
except ImportError:  # imported from the tools directory, not as a package
    import runner
    from jsonlite import dumps, loads

import unittest  # noqa: F401 - imported once here, inherited warm by every job

_LIBC = ctypes.CDLL(None, use_errno=True)
_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
_CLONE_NEWPID, _CLONE_NEWNET = 0x20000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 1 << 14, 1 << 18
_MNT_DETACH = 2
_PR_CAPBSET_DROP, _PR_SET_SECUREBITS, _PR_CAP_AMBIENT = 24, 28, 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
# noroot, no_setuid_fixup, keep_caps off, no_cap_ambient_raise: each with its lock bit
_SECUREBITS = 0x01 | 0x02 | 0x04 | 0x08 | 0x20 | 0x80
_SYS_CAPSET = {"x86_64": 126, "aarch64": 91}
_LAYERS = "/.layers"
_WS = "/workspace"


def _check(rc, what):
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data=None):
    _check(
        _LIBC.mount(
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
    _mount("tmpfs", scratch, "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={int(job['disk'])},mode=755")
    for d in ("upper", "work"):
        os.mkdir(f"{scratch}/{d}", 0o755)
    lowers = ":".join(_esc(f"{_LAYERS}/{p}") for p in job["lowers"])  # top layer first
    opts = f"lowerdir={lowers},upperdir={scratch}/upper,workdir={scratch}/work,userxattr"
    _mount("overlay", _WS, "overlay", _MS_NOSUID | _MS_NODEV, opts)
    # the overlay keeps its layers; the host's layer directory leaves this view entirely
    _check(_LIBC.umount2(_LAYERS.encode(), _MNT_DETACH), f"umount {_LAYERS}")
    _check(_LIBC.umount2(scratch.encode(), _MNT_DETACH), "detach the scratch tmpfs")
    tmp = f"size={int(job['tmp'])},mode=1777"
    _mount("tmpfs", "/tmp", "tmpfs", _MS_NOSUID | _MS_NODEV, tmp)
    _mount("tmpfs", "/dev/shm", "tmpfs", _MS_NOSUID | _MS_NODEV, tmp)
    _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    with open("/proc/sys/user/max_user_namespaces", "w") as f:  # no user namespaces from here
        f.write("0")
    for sub in ("sys", "sysrq-trigger", "irq", "bus"):  # as bwrap does: read-only there
        path = f"/proc/{sub}"
        if os.path.exists(path):
            _mount(path, path, None, _MS_BIND | _MS_REC)
            _mount("none", path, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY)


def _loopback_up():
    import fcntl

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s.fileno(), 0x8914, struct.pack("16sH", b"lo", 0x1 | 0x40))  # UP|RUNNING


def _drop_privileges():
    """No capabilities and no way back to them for what runs next."""
    for cap in range(64):
        if _LIBC.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break  # past the last capability this kernel knows
    _check(_LIBC.prctl(_PR_SET_SECUREBITS, _SECUREBITS, 0, 0, 0), "securebits")
    _check(_LIBC.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clear ambient")
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = (ctypes.c_uint32 * 6)()
    nr = _SYS_CAPSET.get(os.uname().machine)
    if nr is None:
        raise OSError(0, f"unsupported architecture {os.uname().machine}")
    _check(_LIBC.syscall(nr, header, data), "capset")
    with open("/proc/self/status") as f:
        status = f.read()
    for key in ("CapEff:", "CapPrm:", "CapBnd:", "CapAmb:"):
        if int(status.split(key, 1)[1].split()[0], 16):
            raise OSError(0, f"capabilities left after dropping them ({key})")


def _limits(job):
    for res, value in (
        (resource.RLIMIT_CPU, job.get("cpu")),
        (resource.RLIMIT_FSIZE, job.get("fsize")),
        (resource.RLIMIT_NOFILE, job.get("nofile")),
    ):
        if value:
            resource.setrlimit(res, (int(value), int(value)))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _fatal(sock, text):
    try:  # noqa: SIM105 - contextlib is a costly import here
        sock.sendall((dumps({"fatal": text}) + "\n").encode())
    except OSError:
        pass


def _job_init(job, sock):
    """Pid 1 of the job's namespaces: build its sandbox, then run the tests in-process."""
    try:
        _setup_mounts(job)
        _loopback_up()
        _drop_privileges()
        _limits(job)
    except Exception as e:
        _fatal(sock, f"grading sandbox setup failed: {type(e).__name__}: {e}")
        os._exit(70)
    # workspace modules may have these names; the functions below are already bound
    for name in ("grader", "runner", "jsonlite"):
        sys.modules.pop(name, None)
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    results = os.fdopen(os.dup(sock.fileno()), "w", buffering=1)
    sock.close()
    os.closerange(3, results.fileno())
    os.closerange(results.fileno() + 1, 65536)
    spec = dict(job["spec"], workspace=_WS)
    try:
        runner.run(spec, results)
    except BaseException as e:  # the tests' own errors are reported per test; this is not
        results.write(dumps({"fatal": f"test runner failed: {type(e).__name__}: {e}"}) + "\n")
        results.flush()
        os._exit(71)
    results.flush()
    os._exit(0)


def _job(job, sock):
    """The forked child: report to the host, wait to be placed in the job's cgroup, then
    enter fresh namespaces (its child is pid 1 there) and wait for it."""
    try:
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sock.sendall(b"r")  # the host reads our pid from the socket's credentials
        if sock.recv(1) != b"g":
            os._exit(72)
        _check(
            _LIBC.unshare(
                _CLONE_NEWNS | _CLONE_NEWPID | _CLONE_NEWNET | _CLONE_NEWIPC | _CLONE_NEWUTS
            ),
            "unshare",
        )
        pid = os.fork()
        if pid == 0:
            _job_init(job, sock)
        sock.close()
        _, status = os.waitpid(pid, 0)
        os._exit(min(255, max(0, os.waitstatus_to_exitcode(status))))
    except BaseException as e:
        _fatal(sock, f"grading job failed to start: {type(e).__name__}: {e}")
        os._exit(73)


def main():
    ctl = socket.socket(fileno=int(sys.argv[1]))
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # jobs are reaped by the kernel
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    ctl.send(b"ready")
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(ctl, 1 << 20, 1)
        except InterruptedError:
            continue
        if not msg:
            return
        if not fds:
            continue
        sock = socket.socket(fileno=fds[0])
        try:
            job = loads(msg.decode("utf-8"))
            pid = os.fork()
        except Exception as e:
            _fatal(sock, f"grading job was not started: {type(e).__name__}: {e}")
            sock.close()
            continue
        if pid == 0:
            ctl.close()
            _job(job, sock)
        sock.close()


if __name__ == "__main__":
    main()
