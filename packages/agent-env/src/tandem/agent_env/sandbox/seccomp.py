"""The seccomp filter of every sandbox: classic BPF built here, no libseccomp.

bwrap loads it (``--seccomp FD``) just before it runs the sandbox's first program; a job of the
fork server installs it itself once its sandbox is built (``inside/forkserver_server.py``).
Filters are inherited by every process the sandbox starts and cannot be removed.

Denied calls fail with EPERM (programs see an ordinary permission error and carry on); a call
made through another ABI (i386 ``int 0x80`` or x32 on x86_64) kills the process, so the
numbers below cannot be side-stepped. Why each group is denied:

- ``ptrace``, ``process_vm_readv``/``writev``, ``pidfd_getfd``: reading or steering another
  process of the sandbox, above all its supervisor and the descriptors it holds to the host.
- ``keyctl``, ``add_key``, ``request_key``: the kernel keyring is not namespaced; keys of the
  host's user (the trainer's session keyring) would be readable, and keys stored by one
  episode readable by the next. Only ``keyctl(KEYCTL_JOIN_SESSION_KEYRING, NULL)`` is let
  through: it gives the caller a new, empty session keyring (each sandbox starts with one).
- ``io_uring_setup``/``enter``/``register``: a large kernel attack surface, and io_uring work
  is not seen by this filter.
- ``bpf``, ``perf_event_open``, ``userfaultfd``: kernel attack surface (JIT, PMU, page-fault
  handling used to win races in exploits) that no test or build needs.
- ``kexec_load``, ``kexec_file_load``, ``init_module``, ``finit_module``, ``delete_module``,
  ``reboot``, ``swapon``, ``swapoff``, ``acct``, ``quotactl``, ``syslog``, ``iopl``, ``ioperm``,
  ``settimeofday``, ``clock_settime``, ``clock_adjtime``, ``adjtimex``: administration of the
  machine itself.
- the mount family (``mount``, ``umount2``, ``pivot_root``, ``open_tree``, ``move_mount``,
  ``fsopen``, ``fsconfig``, ``fsmount``, ``fspick``, ``mount_setattr``), ``unshare``, ``setns``:
  the sandbox's view of the file system and its namespaces are fixed before the agent's code
  runs.
- ``open_by_handle_at``, ``name_to_handle_at``, ``lookup_dcookie``, ``fanotify_init``,
  ``uselib``: file access around the mount view, and obsolete or privileged interfaces.
"""

from __future__ import annotations

import os
import platform
import struct

_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_KEYCTL = {"x86_64": 250, "aarch64": 219}
_DENIED: dict[str, dict[str, int]] = {
    "x86_64": {
        "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "pidfd_getfd": 438,
        "add_key": 248, "request_key": 249,
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "bpf": 321, "perf_event_open": 298, "userfaultfd": 323,
        "kexec_load": 246, "kexec_file_load": 320, "init_module": 175, "finit_module": 313,
        "delete_module": 176, "reboot": 169, "swapon": 167, "swapoff": 168, "acct": 163,
        "quotactl": 179, "syslog": 103, "iopl": 172, "ioperm": 173, "settimeofday": 164,
        "clock_settime": 227, "clock_adjtime": 305, "adjtimex": 159,
        "mount": 165, "umount2": 166, "pivot_root": 155, "open_tree": 428, "move_mount": 429,
        "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
        "unshare": 272, "setns": 308,
        "open_by_handle_at": 304, "name_to_handle_at": 303, "lookup_dcookie": 212,
        "fanotify_init": 300, "uselib": 134,
    },
    "aarch64": {
        "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "pidfd_getfd": 438,
        "add_key": 217, "request_key": 218,
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "bpf": 280, "perf_event_open": 241, "userfaultfd": 282,
        "kexec_load": 104, "kexec_file_load": 294, "init_module": 105, "finit_module": 273,
        "delete_module": 106, "reboot": 142, "swapon": 224, "swapoff": 225, "acct": 89,
        "quotactl": 60, "syslog": 116, "settimeofday": 170, "clock_settime": 112,
        "clock_adjtime": 266, "adjtimex": 171,
        "mount": 40, "umount2": 39, "pivot_root": 41, "open_tree": 428, "move_mount": 429,
        "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
        "unshare": 97, "setns": 268,
        "open_by_handle_at": 265, "name_to_handle_at": 264, "lookup_dcookie": 18,
        "fanotify_init": 262,
    },
}  # fmt: skip
_KEYCTL_JOIN_SESSION_KEYRING = 1
_X32_BIT = 0x40000000

# classic BPF opcodes and seccomp return values
_LD_W_ABS, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06
_ALLOW, _KILL_PROCESS, _ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
_EPERM = 1
# offsets in struct seccomp_data: nr, arch, then args[6] (u64, little-endian halves)
_NR, _ARCH_OFF, _ARG0_LO, _ARG1_LO, _ARG1_HI = 0, 4, 16, 24, 28


def denied_calls(machine: str | None = None) -> list[str]:
    """Names of the denied system calls on ``machine`` (this one by default)."""
    m = machine or platform.machine()
    return [*_DENIED[m], "keyctl"]


def build_filter(machine: str | None = None) -> bytes:
    """The filter as an array of ``struct sock_filter`` (what ``--seccomp`` reads)."""
    m = machine or platform.machine()
    if m not in _ARCH:
        raise ValueError(f"no seccomp filter for architecture {m!r}")
    prog: list[tuple[int, object, object, int]] = []  # (code, jt, jf, k); jt/jf may be labels

    def op(code: int, k: int, jt: object = 0, jf: object = 0) -> None:
        prog.append((code, jt, jf, k))

    op(_LD_W_ABS, _ARCH_OFF)
    op(_JEQ_K, _ARCH[m], 1, 0)
    op(_RET_K, _KILL_PROCESS)
    op(_LD_W_ABS, _NR)
    if m == "x86_64":
        op(_JGE_K, _X32_BIT, "kill", 0)
    for nr in sorted(set(_DENIED[m].values())):
        op(_JEQ_K, nr, "deny", 0)
    op(_JEQ_K, _KEYCTL[m], 0, "allow")
    op(_LD_W_ABS, _ARG0_LO)  # keyctl: only JOIN_SESSION_KEYRING with a NULL name
    op(_JEQ_K, _KEYCTL_JOIN_SESSION_KEYRING, 0, "deny")
    op(_LD_W_ABS, _ARG1_LO)
    op(_JEQ_K, 0, 0, "deny")
    op(_LD_W_ABS, _ARG1_HI)
    op(_JEQ_K, 0, 0, "deny")
    labels = {"allow": len(prog)}
    op(_RET_K, _ALLOW)
    labels["deny"] = len(prog)
    op(_RET_K, _ERRNO | _EPERM)
    labels["kill"] = len(prog)
    op(_RET_K, _KILL_PROCESS)
    out = bytearray()
    for i, (code, jt, jf, k) in enumerate(prog):
        jt_n = labels[jt] - i - 1 if isinstance(jt, str) else jt
        jf_n = labels[jf] - i - 1 if isinstance(jf, str) else jf
        assert (
            isinstance(jt_n, int) and isinstance(jf_n, int) and 0 <= jt_n < 256 and 0 <= jf_n < 256
        )
        out += struct.pack("=HBBI", code, jt_n, jf_n, k)
    return bytes(out)


def write_filter(path: str) -> str:
    """Write the filter to ``path`` (read by bwrap and the fork server); returns ``path``."""
    data = build_filter()
    with open(path, "wb") as f:
        f.write(data)
    os.chmod(path, 0o444)
    return path
