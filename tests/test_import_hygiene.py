"""Importing a library has no global side effects, and the torch-free ones stay torch-free.

Each import runs in a fresh interpreter, so what one package's import does cannot hide
behind what the test process already loaded.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from importlib import import_module
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARIES = {
    "tandem.moe_determinism": ("packages/moe-determinism", True),
    "tandem.grpo": ("packages/grpo", True),
    "tandem.delta_sync": ("packages/delta-sync", False),
    "tandem.agent_env": ("packages/agent-env", False),
    "tandem.orchestrator": ("packages/orchestrator", True),
    "tandem.app": ("apps/tandem", True),
}


@pytest.mark.parametrize("module", list(LIBRARIES))
def test_version_matches_metadata(module: str) -> None:
    member, _ = LIBRARIES[module]
    meta = tomllib.loads((ROOT / member / "pyproject.toml").read_text())
    assert import_module(module).__version__ == meta["project"]["version"]


@pytest.mark.parametrize("module", list(LIBRARIES))
def test_import_has_no_global_side_effects(module: str) -> None:
    """No logging configuration, no environment change, torch only where it is declared."""
    code = (
        "import logging, os, sys; env = dict(os.environ); "
        f"import {module}; "
        "assert not logging.getLogger().handlers, 'root logger configured at import'; "
        "assert dict(os.environ) == env, 'environment changed at import'; "
        "print(int('torch' in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    if not LIBRARIES[module][1]:
        assert proc.stdout.strip() == "0", f"{module} must import without torch"
