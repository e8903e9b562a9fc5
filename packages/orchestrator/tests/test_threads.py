"""torch's thread count for a stage: set inside the block, restored after, checked."""

from __future__ import annotations

import threading

import pytest
import torch

from tandem.orchestrator.runtime.threads import SpareCores, torch_threads


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


class _Recording(torch.nn.Module):
    """Two layers that record the thread count they run forward, and backward, on."""

    def __init__(self, seen: list[tuple[str, int]]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Layer(seen, i) for i in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class _CountInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, seen: list, name: str) -> torch.Tensor:  # type: ignore[override]
        ctx.seen, ctx.name = seen, name
        return x * 2

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        ctx.seen.append((f"{ctx.name}.backward", torch.get_num_threads()))
        return grad * 2, None, None


class _Layer(torch.nn.Module):
    def __init__(self, seen: list[tuple[str, int]], i: int) -> None:
        super().__init__()
        self.seen, self.name = seen, f"layer{i}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((f"{self.name}.forward", torch.get_num_threads()))
        return _CountInBackward.apply(x, self.seen, self.name)


def test_spare_cores_follow_the_engines_layer_by_layer_forward_and_backward() -> None:
    seen: list[tuple[str, int]] = []
    model = _Recording(seen)
    # one answer per layer boundary, forward then backward: idle for layer 0's forward, busy
    # for layer 1's forward and backward, idle again for layer 0's backward
    answers = iter([True, False, False, True])
    cores = SpareCores(1, 2, lambda: next(answers))
    detach = cores.attach(model)
    elsewhere: list[int] = []
    with torch_threads(1):
        x = torch.ones(3, requires_grad=True)
        model(x).sum().backward()
        assert x.grad is not None and torch.equal(x.grad, torch.full((3,), 4.0))
        # only the computing thread's count changed: a thread started now keeps the process's
        t = threading.Thread(target=lambda: elsewhere.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert torch.get_num_threads() == 2  # the step ended wide
        assert cores.end_step() > 0 and torch.get_num_threads() == 1
        assert cores.end_step() == 0.0
    assert seen == [
        ("layer0.forward", 2),
        ("layer1.forward", 1),
        ("layer1.backward", 1),
        ("layer0.backward", 2),
    ]
    assert elsewhere == [1]
    assert cores.switches == 4  # the last one by `end_step`
    detach()
    seen.clear()
    with torch_threads(1):
        model(torch.ones(3, requires_grad=True)).sum().backward()  # no hooks: no answers asked
    assert [n for _, n in seen] == [1, 1, 1, 1]


def test_spare_cores_refuse_counts_out_of_order_and_models_without_layers() -> None:
    with pytest.raises(ValueError, match="narrow <= wide"):
        SpareCores(2, 1, lambda: True)
    with pytest.raises(TypeError, match="has no `layers`"):
        SpareCores(1, 2, lambda: True).attach(torch.nn.Linear(2, 2))
