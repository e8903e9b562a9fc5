"""Workspace-wide pytest setup: `gpu` tests are skipped automatically on machines without CUDA."""

from __future__ import annotations

import functools

import pytest


@functools.cache
def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none visible to torch here)")
    for item in items:
        if "gpu" in item.keywords and not _cuda_available():
            item.add_marker(skip_gpu)
