"""Workspace-wide pytest setup: `gpu` tests are skipped automatically on machines without CUDA,
and Ray clusters started by tests run their workers without `uv run`."""

from __future__ import annotations

import functools
import os

import pytest

# Ray workers of the clusters tests start run with this interpreter. Ray reads the switch
# when it is first imported (test modules import it before `backends.ray.cluster.connect` could set
# it), and with it on every worker process would start through `uv run`, which packages the
# working tree and resolves the environment again for each one.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")


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
