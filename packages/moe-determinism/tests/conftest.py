"""Shared helpers for the moe-determinism tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tandem.moe_determinism.ops import workers


@pytest.fixture(params=[1, 2], ids=["threads1", "threads2"])
def threads(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """Run the test with 1 and with 2 torch threads, restoring the count afterwards. With 2,
    the workers share every product of more than one tile job, however small (by default
    only large ones), so the tests' small products go through them too."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    if request.param > 1:
        monkeypatch.setattr(workers, "SHARED_WORK", 0)
    try:
        yield request.param
    finally:
        torch.set_num_threads(before)
