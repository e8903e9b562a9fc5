"""cgroup handling: v2 files written for a delegated subtree, counters parsed, v1 for real."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tandem.agent_env.errors import SandboxError
from tandem.agent_env.sandbox.cgroups import CgroupManager, EpisodeCgroup


def test_v2_delegated_subtree_gets_limits_and_controllers(tmp_path: Path) -> None:
    """A directory shaped like a delegated cgroup v2 subtree (the kernel would create the
    interface files; here they are plain files, so only what tandem writes is checked)."""
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    mgr = CgroupManager(cgroup_root=str(tmp_path))
    (parent,) = mgr.parents.values()
    assert mgr.version == 2 and parent.parent == tmp_path
    assert parent.name.startswith(f"tandem-agent-env-{os.getpid()}-")
    assert set((parent / "cgroup.subtree_control").read_text().split()) == {"+pids", "+memory"}
    cg = mgr.create(memory_bytes=300 << 20, pids=77)
    d = cg.dirs[""]
    assert (d / "memory.max").read_text() == str(300 << 20)
    assert (d / "memory.swap.max").read_text() == "0"
    assert (d / "pids.max").read_text() == "77"
    assert cg.procs_files == [str(d / "cgroup.procs")]
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 5\noom 2\noom_kill 2\n")
    (d / "pids.events").write_text("max 13\n")
    assert cg.oom_kills() == 2 and cg.pids_limit_hits() == 13


def test_cgroup_root_that_is_not_v2_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SandboxError, match="not a cgroup v2 directory"):
        CgroupManager(cgroup_root=str(tmp_path))


@pytest.mark.skipif(
    not Path("/sys/fs/cgroup/pids/cgroup.procs").exists(), reason="needs cgroup v1 pids"
)
def test_v1_episode_cgroup_limits_and_removal() -> None:
    mgr = CgroupManager()
    parents = list(mgr.parents.values())
    try:
        cg = mgr.create(memory_bytes=64 << 20, pids=9)
        assert isinstance(cg, EpisodeCgroup) and cg.version == 1
        assert (cg.dirs["pids"] / "pids.max").read_text().strip() == "9"
        assert int((cg.dirs["memory"] / "memory.limit_in_bytes").read_text()) == 64 << 20
        assert cg.pids() == [] and cg.oom_kills() == 0
        cg.remove()
        assert not any(d.exists() for d in cg.dirs.values())
    finally:
        mgr.close()
    assert parents and not any(p.exists() for p in parents)


def _fork_refused_in(cg: EpisodeCgroup) -> None:
    """A process joins ``cg`` (pids limit 1), fails to fork there and exits."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.read(r, 1)
        try:
            child = os.fork()
        except OSError:
            os._exit(0)
        if child == 0:
            os._exit(0)
        os._exit(1)
    cg.join(pid)
    os.write(w, b"g")
    _, status = os.waitpid(pid, 0)
    os.close(r)
    os.close(w)
    assert os.waitstatus_to_exitcode(status) == 0  # the fork was refused at the limit


def test_v1_emptied_groups_are_recycled_with_their_counters_reset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mgr = CgroupManager()
    try:
        cg = mgr.create(memory_bytes=64 << 20, pids=1)
        _fork_refused_in(cg)
        assert cg.pids_limit_hits() == 1
        assert cg.recycle()
        assert all(d.exists() for d in cg.dirs.values())  # kept, not removed
        again = mgr.create(memory_bytes=64 << 20, pids=1)
        assert again is cg and again.pids_limit_hits() == 0 and again.oom_kills() == 0
        assert (again.dirs["pids"] / "pids.max").read_text().strip() == "1"
        _fork_refused_in(again)
        assert again.pids_limit_hits() == 1  # counted from the reuse on
        other = mgr.create(memory_bytes=32 << 20, pids=1)  # other limits: a group of its own
        assert other.dirs != cg.dirs
        # a group that still has a process is not kept
        proc = os.fork()
        if proc == 0:
            time.sleep(30)
            os._exit(0)
        other.join(proc)
        assert not other.recycle()
        assert mgr.create(memory_bytes=32 << 20, pids=1).dirs != other.dirs
        os.kill(proc, 9)
        os.waitpid(proc, 0)
        assert other.rmdir()
        # past IDLE_GROUPS emptied groups are removed, not kept
        monkeypatch.setattr("tandem.agent_env.sandbox.cgroups.IDLE_GROUPS", 1)
        first, second = mgr.create(64 << 20, 1), mgr.create(64 << 20, 1)
        assert first.recycle() and second.recycle()
        assert all(d.exists() for d in first.dirs.values())
        assert not any(d.exists() for d in second.dirs.values())
    finally:
        mgr.close()
