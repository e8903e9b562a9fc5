"""Package metadata and import hygiene for tandem-moe-determinism."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import tandem.moe_determinism as pkg

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_version_matches_metadata() -> None:
    assert pkg.__version__ == tomllib.loads(PYPROJECT.read_text())["project"]["version"]


def test_import_has_no_global_side_effects() -> None:
    """Importing the library must not configure logging or touch the environment."""
    code = (
        "import logging, os, sys; env = dict(os.environ); "
        "import tandem.moe_determinism; "
        "assert not logging.getLogger().handlers, 'root logger configured at import'; "
        "assert dict(os.environ) == env, 'environment changed at import'; "
        "print(int('torch' in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
