"""Shared helpers for the moe-determinism tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(params=[1, 2], ids=["threads1", "threads2"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """Run the test with 1 and with 2 torch threads, restoring the count afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    try:
        yield request.param
    finally:
        torch.set_num_threads(before)
