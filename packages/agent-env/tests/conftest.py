"""Shared fixtures: tight sandbox limits so hostile commands end fast, a one-file task, and a
leak check."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tandem.agent_env import EnvConfig, HiddenTests, SandboxConfig, SandboxLimits, Task
from tandem.agent_env.config import MiB
from tandem.agent_env.sandbox.runtime import Runtime

LIMITS = SandboxLimits(
    memory_bytes=256 * MiB,
    pids=64,
    cpu_seconds=10,
    command_timeout_s=30.0,  # generous: the machine may be busy; timeout tests shorten it
    file_size_bytes=32 * MiB,
    open_files=256,
    tmp_bytes=32 * MiB,
    disk_bytes=64 * MiB,
    max_output_bytes=4 * MiB,
)
CONFIG = EnvConfig(sandbox=SandboxConfig(limits=LIMITS), grade_timeout_s=30.0)


@pytest.fixture
def config() -> EnvConfig:
    return CONFIG


@pytest.fixture
def add_task() -> Task:
    """A one-file task: `add` subtracts; one hidden test asks for 2 + 3 == 5."""
    return Task(
        id="add",
        instruction="`add(2, 3)` returns -1; it should return 5. Fix calc.py.",
        files={"calc.py": "def add(a, b):\n    return a - b\n", "tests/__init__.py": ""},
        hidden_tests=HiddenTests(
            fail_to_pass=("tests.test_hidden.H.test_add",),
            files={
                "tests/test_hidden.py": (
                    "import unittest\nfrom calc import add\n\n\nclass H(unittest.TestCase):\n"
                    "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n"
                )
            },
        ),
    )


def live_episode_state() -> dict[str, list[str]]:
    """Episode cgroups in use, episode directories and processes still alive in any runtime
    (emptied groups kept for reuse are not in use, but a process in one would be listed)."""
    left: dict[str, list[str]] = {"cgroups": [], "episodes": [], "pids": []}
    for rt in list(Runtime._shared.values()):
        if rt.cgroups is not None:
            idle = rt.cgroups.idle_dirs()
            for parent in rt.cgroups.parents.values():
                for d in parent.glob("ep-*"):
                    if d not in idle:
                        left["cgroups"].append(str(d))
                    procs = (
                        (d / "cgroup.procs").read_text().split()
                        if (d / "cgroup.procs").exists()
                        else []
                    )
                    left["pids"] += procs
        if rt.root is not None and (rt.root / "episodes").exists():
            left["episodes"] += [str(p) for p in (rt.root / "episodes").iterdir()]
    return left


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """Every test must leave no cgroup, process or episode directory behind."""
    yield
    left = live_episode_state()
    assert left == {"cgroups": [], "episodes": [], "pids": []}, left
