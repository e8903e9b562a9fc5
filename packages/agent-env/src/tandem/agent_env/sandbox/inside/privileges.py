"""Dropping every capability of a fork-server job, for good, before its untrusted code runs.

A job enters a user namespace of its own (``forkserver_server._become_agent``) and gets a full
capability set in it. bwrap drops those for a sandbox it starts; a fork-server job drops them
itself: the bounding and ambient sets, the effective, permitted and inheritable ones
(``capset``), and it locks the securebits so that neither an exec nor a uid change gives any
back. It then checks in ``/proc/self/status`` that none is left.

Used by the fork server only (whose interpreter has ``ctypes`` loaded already). Everything a
job needs is prepared before the fork (`last_cap`, `warm`): objects made after it land on
pages each job copies.
"""

import ctypes
import os

_PR_CAPBSET_READ, _PR_CAPBSET_DROP, _PR_SET_SECUREBITS, _PR_CAP_AMBIENT = 23, 24, 28, 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
# noroot, no_setuid_fixup, keep_caps off, no_cap_ambient_raise: each with its lock bit
_SECUREBITS = 0x01 | 0x02 | 0x04 | 0x08 | 0x20 | 0x80
_SYS_CAPSET = {"x86_64": 126, "aarch64": 91}
_CapHeader, _CapData = ctypes.c_uint32 * 2, ctypes.c_uint32 * 6
_CAPSET_NR = _SYS_CAPSET.get(os.uname().machine)
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
DEFAULT_LAST_CAP = 63  # when the kernel does not say: jobs drop up to the first one it refuses


def _check(rc, what):
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def last_cap():
    """The highest capability this kernel knows, read once by the server for all its jobs."""
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            return int(f.read())
    except (OSError, ValueError):
        return DEFAULT_LAST_CAP


def warm(lib):
    """The first call of ``prctl`` and the first capability structs, made in the server before
    it forks (ctypes caches what a first use builds) rather than in each job."""
    lib.prctl(_PR_CAPBSET_READ, 0, 0, 0, 0)
    _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0), _CapData()


def drop_privileges(top_cap, lib):
    """No capabilities and no way back to them for what runs next (``top_cap``: from
    `last_cap`; ``lib``: the server's libc, its functions looked up before the fork)."""
    prctl = lib.prctl
    for cap in range(top_cap + 1):
        if prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break  # past the last capability this kernel knows (when it could not be read)
    _check(prctl(_PR_SET_SECUREBITS, _SECUREBITS, 0, 0, 0), "securebits")
    _check(prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clear ambient")
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)  # this thread
    data = _CapData()
    if _CAPSET_NR is None:
        raise OSError(0, f"unsupported architecture {os.uname().machine}")
    _check(lib.syscall(_CAPSET_NR, header, data), "capset")
    fd = os.open("/proc/self/status", os.O_RDONLY | os.O_CLOEXEC)
    try:
        status = os.read(fd, 1 << 16)
    finally:
        os.close(fd)
    for key in (b"CapEff:", b"CapPrm:", b"CapBnd:", b"CapAmb:"):
        if int(status.split(key, 1)[1].split()[0], 16):
            raise OSError(0, f"capabilities left after dropping them ({key.decode()})")
