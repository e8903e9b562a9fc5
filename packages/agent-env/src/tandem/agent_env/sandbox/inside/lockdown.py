"""Last steps before untrusted code runs in a sandbox: an empty session keyring of its own,
a supervisor that cannot be inspected, and (in a fork-server job) the seccomp filter.

bwrap loads the filter itself (``--seccomp``); a job of the fork server, which needs the mount
calls to build its sandbox, installs it once that is done. ctypes is imported only when
called: a fork-server job has it loaded already, a bwrap sandbox pays for it once.
"""

import os

_KEYCTL = {"x86_64": 250, "aarch64": 219}
_KEYCTL_JOIN_SESSION_KEYRING = 1
_PR_SET_DUMPABLE, _PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP = 4, 38, 22
_SECCOMP_MODE_FILTER = 2


def _libc():
    import ctypes

    return ctypes, ctypes.CDLL(None, use_errno=True)


def own_keyring(libc=None):
    """Join a new, empty, anonymous session keyring: keys of the host's user (the same user
    as the sandbox's on the host) are not reachable from here, nor kept for later episodes."""
    ctypes, lib = _libc() if libc is None else libc
    nr = _KEYCTL.get(os.uname().machine)
    if nr is None or lib.syscall(nr, _KEYCTL_JOIN_SESSION_KEYRING, None) < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"could not join a new session keyring: {os.strerror(err)}")


def not_dumpable(libc=None):
    """No ptrace, ``pidfd_getfd`` or ``/proc/<pid>/fd`` access to this process from other
    processes of the same user (the agent's): its channel to the host stays its own. A
    program it starts is dumpable again once it execs."""
    ctypes, lib = _libc() if libc is None else libc
    if lib.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"could not make the process non-dumpable: {os.strerror(err)}")


def filter_program(data, libc=None):
    """A ``struct sock_fprog`` for the filter ``data`` (an array of struct sock_filter), made
    once by the fork server before it forks (fewer objects made, and pages copied, per job)."""
    ctypes, _ = _libc() if libc is None else libc

    class Prog(ctypes.Structure):
        _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_char_p))

    return Prog(len(data) // 8, data)


def install_filter(prog, libc=None):
    """Install the seccomp filter ``prog`` (from `filter_program`) for this process and
    everything it starts; no new privileges from then on."""
    ctypes, lib = _libc() if libc is None else libc
    if lib.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS failed")
    if lib.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"could not install the seccomp filter: {os.strerror(err)}")
