"""Every package README opens with a short usage example, and the example runs as written.

Python examples run in a fresh interpreter in an empty directory; shell examples run from
the repository root, as a newcomer would type them after the two commands of the README.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
READMES = sorted([*ROOT.glob("packages/*/README.md"), ROOT / "apps" / "tandem" / "README.md"])
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def first_example(readme: Path) -> tuple[str, str]:
    match = FENCE.search(readme.read_text())
    assert match, f"{readme.relative_to(ROOT)} has no code block"
    return match.group(1), match.group(2)


@pytest.mark.parametrize("readme", READMES, ids=lambda p: p.parent.name)
def test_the_first_example_is_short_and_runs(readme: Path, tmp_path: Path) -> None:
    lang, code = first_example(readme)
    assert lang in ("python", "bash"), f"the first block of {readme} is {lang or 'untagged'}"
    lines = [line for line in code.splitlines() if line.strip()]
    assert 3 <= len(lines) <= 6, f"{readme}: a usage example of about 5 lines, not {len(lines)}"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if lang == "python":
        cmd, cwd = [sys.executable, "-c", code], tmp_path
    else:
        cmd, cwd = ["bash", "-euo", "pipefail", "-c", code], ROOT
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{readme}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert proc.stdout.strip(), f"{readme}: the example printed nothing"
