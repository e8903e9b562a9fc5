"""Fixtures of the tandem-grpo tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

HERE = Path(__file__).resolve().parent


def _load(name: str) -> ModuleType:
    """A helper module of this folder, loaded by path (tests are not a package)."""
    spec = importlib.util.spec_from_file_location(f"grpo_{name}", HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny() -> ModuleType:
    """The tiny_policy helper module."""
    return _load("tiny_policy")


@pytest.fixture(scope="session")
def chains() -> ModuleType:
    """The segment_chains helper module: episodes cut into segments, a bigram policy."""
    return _load("segment_chains")
