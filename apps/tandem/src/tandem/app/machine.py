"""Where a run ran: the CPU's model and the flags that decide its speed, cores and threads.

The demo's figures depend on the machine (a CPU without AVX-512 runs the same work slower),
so its report names the machine next to them.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from pathlib import Path

import msgspec

# The instruction sets torch's CPU kernels pick their fast paths by.
SPEED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile")


class Machine(msgspec.Struct, frozen=True):
    """The CPU model, its speed-relevant flags (of `SPEED_FLAGS`), and the cores this
    process may use."""

    cpu: str
    flags: tuple[str, ...]
    cores: int


def parse_cpuinfo(text: str) -> tuple[str | None, tuple[str, ...]]:
    """The first ``model name`` and the `SPEED_FLAGS` the first ``flags`` line lists (Linux's
    /proc/cpuinfo layout: ``key<tabs>: value`` lines, one block per logical CPU)."""
    model: str | None = None
    flags: set[str] | None = None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip() or None
        elif key == "flags" and flags is None:
            flags = set(value.split())
    return model, tuple(f for f in SPEED_FLAGS if flags and f in flags)


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def this_machine(cpuinfo: Path = Path("/proc/cpuinfo")) -> Machine:
    """This machine; the CPU model from /proc/cpuinfo, else `platform.processor()`."""
    try:
        model, flags = parse_cpuinfo(cpuinfo.read_text(errors="replace"))
    except OSError:
        model, flags = None, ()
    return Machine(
        cpu=model or platform.processor() or platform.machine() or "unknown CPU",
        flags=flags,
        cores=usable_cores(),
    )


def machine_line(machine: Machine, threads: Sequence[tuple[str, int]]) -> str:
    """One line: CPU, flags, cores, then torch's thread count per stage, e.g.
    ``AMD EPYC (avx2, avx512f), 2 cores; torch threads: 2 mid-training/eval, 1 RL``."""
    flags = ", ".join(machine.flags) if machine.flags else "no AVX2/AVX-512/AMX"
    counts = ", ".join(f"{n} {stage}" for stage, n in threads)
    plural = "s" if machine.cores != 1 else ""
    return f"{machine.cpu} ({flags}), {machine.cores} core{plural}; torch threads: {counts}"
