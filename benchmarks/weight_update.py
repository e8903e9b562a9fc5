"""One RL step's weight update for the serving benchmarks: a published delta, and the pause
each engine takes to apply it.

`publish_update` writes two versions of a policy into a local delta-sync store: version 0
(its weights) and version 1 (about 3% of every tensor's elements changed, as an RL step
changes bf16 weights). An engine holding version 0 then prepares version 1 while it could
still serve and applies it in a pause: `embedded_update` measures the embedded engine's,
`smollm2_vllm.vllm_side` a vLLM server's (its plugin's `/pause` to `/resume`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch


def perturbed(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """The policy's state with about 3% of every tensor's elements changed; tied tensors
    (an embedding shared with the output head) stay one tensor, changed once."""
    g = torch.Generator().manual_seed(seed)
    copies: dict[int, torch.Tensor] = {}
    state = {}
    for name, v in model.state_dict().items():
        if v.data_ptr() not in copies:
            t = copies[v.data_ptr()] = v.detach().clone()
            mask = torch.rand(t.shape, generator=g) < 0.03
            t[mask] += 0.01 * torch.randn(t.shape, generator=g)[mask]
        state[name] = copies[v.data_ptr()]
    return state


def publish_update(model: Any, store: Path, seed: int = 1) -> int:
    """Versions 0 and 1 of ``model`` in a local store at ``store``; the bytes an engine
    holding version 0 downloads for version 1."""
    from tandem.delta_sync import LocalStore, Publisher

    publisher = Publisher(LocalStore(store))
    publisher.publish(0, {k: v.detach() for k, v in model.state_dict().items()})
    report = publisher.publish(1, perturbed(model, seed))
    publisher.close()
    return int(report.step_bytes)


def embedded_update(engine: Any, store: Path) -> dict[str, float]:
    """Prepare version 1 for ``engine`` (holding version 0), then apply it: the pause."""
    from tandem.delta_sync import LocalStore, Subscriber

    t0 = time.perf_counter()
    prepared = Subscriber(LocalStore(store), version=0).prepare(1)
    prepare_s = time.perf_counter() - t0
    engine.stage_update(prepared)
    report = engine.apply_pending()
    return {"prepare_s": prepare_s, "pause_s": float(report.apply_seconds)}
