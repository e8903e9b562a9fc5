"""How many threads torch's CPU kernels use while a stage runs in this process."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from tandem.moe_determinism.ops.workers import set_own_thread_count


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run the block with ``count`` intra-op threads (0: leave torch's setting), then restore.

    The local RL backend runs the engine and the trainer as two threads of one process. Each
    op of either spreads over every core by default, so on a small machine they take cores
    from each other (and spin waiting for them); one thread each lets them run side by side.
    """
    if count < 0:
        raise ValueError(f"torch_threads: count must be >= 0, got {count}")
    before = torch.get_num_threads()
    if count:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class SpareCores:
    """The trainer's torch threads follow the engines: ``narrow`` while a group is being
    played on this machine, ``wide`` while none is.

    On a small machine the engine and the trainer each get a core (`torch_threads`), and
    when the engine has nothing to play (the staleness bound reached, the run's last groups
    played) its core idles while the trainer steps on one. Attached to a model, the count is
    chosen again before each of its layers runs forward and before its gradient flows back
    through it, on the thread that computes it (OpenMP and MKL counts are per thread), so a
    trainer gets the spare core within one layer's time and gives it back as soon. Only the
    computing thread's count changes (`set_own_thread_count`): an engine thread of the same
    process, or a thread started later, keeps its own. The batch-invariant products share
    their rows among however many threads there are: the bits do not depend on the count.
    """

    def __init__(self, narrow: int, wide: int, engines_idle: Callable[[], bool]) -> None:
        if not 1 <= narrow <= wide:
            raise ValueError(f"SpareCores: need 1 <= narrow <= wide, got {narrow} and {wide}")
        self.narrow, self.wide, self.engines_idle = narrow, wide, engines_idle
        self.switches = 0
        self._wide_s = 0.0
        self._since: float | None = None  # when the current wide stretch began

    def apply(self) -> None:
        """Set the calling thread's count for what runs next."""
        self._set(self.wide if self.engines_idle() else self.narrow)

    def end_step(self) -> float:
        """The trainer has stopped: the calling thread goes back to ``narrow`` (a wide
        stretch ends here, not at the next step's first layer). Returns the seconds computed
        wide since the last call."""
        self._set(self.narrow)
        taken, self._wide_s = self._wide_s, 0.0
        return taken

    def _set(self, want: int) -> None:
        now = time.perf_counter()
        if self._since is not None:
            self._wide_s += now - self._since
        self._since = now if want != self.narrow else None
        if torch.get_num_threads() != want:
            set_own_thread_count(want)
            self.switches += 1

    def attach(self, model: nn.Module) -> Callable[[], None]:
        """Choose the count at every layer of ``model`` (its ``layers``); returns the
        function that removes the hooks."""
        layers = getattr(model, "layers", None)
        if not isinstance(layers, nn.ModuleList):
            raise TypeError(f"SpareCores: {type(model).__name__} has no `layers` to follow")

        def before(_module: nn.Module, _args: Any) -> None:
            self.apply()

        def after(_module: nn.Module, _args: Any, output: Any) -> None:
            h = output[0] if isinstance(output, tuple) else output
            if isinstance(h, torch.Tensor) and h.requires_grad:
                h.register_hook(lambda _grad: self.apply())

        handles = [layer.register_forward_pre_hook(before) for layer in layers]
        handles += [layer.register_forward_hook(after) for layer in layers]

        def detach() -> None:
            for handle in handles:
                handle.remove()

        return detach
