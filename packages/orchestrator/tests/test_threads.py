"""torch's thread count for a stage: set inside the block, restored after, checked."""

from __future__ import annotations

import threading

import pytest
import torch

from tandem.orchestrator.runtime.threads import torch_threads


def test_the_count_holds_inside_and_is_restored_after() -> None:
    seen: list[int] = []
    with torch_threads(2):  # a known count to come back to, whatever this machine's default
        with torch_threads(1):
            seen.append(torch.get_num_threads())
            # a thread started inside the block (as the engine's and trainer's are) runs with it
            t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
            t.start()
            t.join()
        assert seen == [1, 1]
        assert torch.get_num_threads() == 2
        with torch_threads(0):
            assert torch.get_num_threads() == 2


def test_the_count_is_restored_when_the_block_fails() -> None:
    with torch_threads(2):
        with pytest.raises(RuntimeError, match="boom"), torch_threads(1):
            raise RuntimeError("boom")
        assert torch.get_num_threads() == 2


def test_a_negative_count_is_refused() -> None:
    with pytest.raises(ValueError, match="count must be >= 0"), torch_threads(-2):
        pass
