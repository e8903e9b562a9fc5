"""Fixtures of the tandem-grpo tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def tiny() -> ModuleType:
    """The tiny_policy helper module (loaded by path: tests are not a package)."""
    spec = importlib.util.spec_from_file_location("grpo_tiny_policy", HERE / "tiny_policy.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
