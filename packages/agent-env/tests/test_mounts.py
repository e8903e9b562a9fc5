"""The workspace mount helper: pipelined requests answered in order, on successive event loops."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from pathlib import Path

import pytest

from tandem.agent_env.errors import SandboxError
from tandem.agent_env.sandbox.mounts import MountHelper

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("nsenter"), reason="needs root and nsenter"
)


def _mounted(helper: MountHelper) -> set[str]:
    """Mount points in the helper's namespace (the host's own does not see them)."""
    text = Path(f"/proc/{helper._proc.pid}/mounts").read_text()
    return {line.split()[1] for line in text.splitlines()}


def test_concurrent_requests_from_two_event_loops_get_their_own_answers(tmp_path: Path) -> None:
    helper = MountHelper(sys.executable, str(tmp_path))
    disks = [str(tmp_path / f"ep{i}" / "disk") for i in range(8)]
    try:

        async def mount_all() -> None:
            await asyncio.gather(*(helper.call("mount", d, 1 << 20, ("work1",)) for d in disks))
            with pytest.raises(SandboxError, match="umount"):  # an error reaches its caller
                await helper.call("umount", str(tmp_path / "not-mounted"))

        asyncio.run(mount_all())
        assert set(disks) <= _mounted(helper)

        async def unmount_all() -> None:  # a second event loop, as a later asyncio.run has
            await asyncio.gather(*(helper.call("umount", d) for d in disks))

        asyncio.run(unmount_all())
        assert not set(disks) & _mounted(helper)
    finally:
        helper.close()
