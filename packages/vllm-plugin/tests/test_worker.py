"""The worker extension's own logic, in a stand-in worker whose model runner records what
vLLM's reload would receive (the real server is exercised by the orchestrator's vLLM tests):
the stream's versions reach the reload bit for bit under the checkpoint's names."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.delta_sync import LocalStore, Publisher
from tandem.vllm_plugin import DeltaSyncExtension, worker

LAYOUT = {
    "model.embed_tokens.weight": ["embed.weight", None],
    "model.layers.0.mlp.experts.0.up_proj.weight": ["up", 0],
    "model.layers.0.mlp.experts.1.up_proj.weight": ["up", 1],
    # a shared expert's: its down projection doubled beside a zero gate
    "model.layers.0.mlp.shared_expert.down_proj.weight": ["down", None, 2.0],
    "model.layers.0.mlp.shared_expert_gate.weight": [None, None, 1.0, [1, 4]],
}


class Runner:
    def __init__(self) -> None:
        self.loads: list[dict[str, torch.Tensor]] = []

    def reload_weights(self, weights_iterator: Any) -> None:
        self.loads.append({name: t.clone() for name, t in weights_iterator})

    def get_model(self) -> torch.nn.Module:
        return torch.nn.Module()


class StandInWorker(DeltaSyncExtension):
    def __init__(self) -> None:
        self.model_runner = Runner()


def states(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = [
        {
            "embed.weight": torch.randn(10, 4, generator=g),
            "up": torch.randn(2, 3, 4, generator=g),
            "down": torch.randn(4, 3, generator=g),
        }
    ]
    for _ in range(n - 1):
        nxt = {k: v.clone() for k, v in out[-1].items()}
        nxt["up"][1, 0, :2] += 1.0  # a few elements change per version
        nxt["down"][0, 1] -= 0.5
        out.append(nxt)
    return out


@pytest.fixture
def store(tmp_path: Path) -> tuple[Path, list[dict[str, torch.Tensor]]]:
    versions = states(3)
    publisher = Publisher(LocalStore(tmp_path / "w"))
    for v, state in enumerate(versions):
        publisher.publish(v, state)
    publisher.close()
    return tmp_path / "w", versions


def expected(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint the layout describes, built entry by entry."""
    out = {}
    for name, (src, i, *rest) in LAYOUT.items():
        scale, zeros = rest[0] if rest else 1.0, rest[1] if len(rest) > 1 else None
        out[name] = (
            torch.zeros(zeros)
            if src is None
            else (state[src] if i is None else state[src][i]) * scale
        )
    return out


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def wait_prepared(w: StandInWorker) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while (status := w.tandem_status())["preparing"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return status


def test_follow_prepare_apply_reach_the_reload_bit_for_bit(store, monkeypatch) -> None:
    path, versions = store
    monkeypatch.setattr(worker, "_reset_cpu_expert_kernels", lambda model: 0)
    w = StandInWorker()
    assert w.tandem_follow(str(path), "1", json.dumps(LAYOUT))["version"] == 1
    assert equal(w.model_runner.loads[-1], expected(versions[1]))  # loaded at once
    w.tandem_prepare("")
    status = wait_prepared(w)
    assert status["prepared"] == 2 and status["error"] is None and status["version"] == 1
    applied = w.tandem_apply()
    assert applied["applied"] and applied["version"] == 2
    assert equal(w.model_runner.loads[-1], expected(versions[2]))
    assert w.tandem_apply() == {"version": 2, "applied": False}  # nothing new prepared
    w.tandem_prepare("")
    assert wait_prepared(w)["prepared"] is None  # nothing newer in the store


def test_a_layout_naming_what_the_stream_lacks_is_refused(store, monkeypatch) -> None:
    path, _ = store
    monkeypatch.setattr(worker, "_reset_cpu_expert_kernels", lambda model: 0)
    bad = {**LAYOUT, "lm_head.weight": ["lm_head.weight", None]}
    with pytest.raises(KeyError, match=r"lm_head\.weight"):
        StandInWorker().tandem_follow(str(path), "0", json.dumps(bad))


def test_a_failed_prepare_is_reported_not_applied(store, monkeypatch) -> None:
    path, _ = store
    monkeypatch.setattr(worker, "_reset_cpu_expert_kernels", lambda model: 0)
    w = StandInWorker()
    w.tandem_follow(str(path), "0", json.dumps(LAYOUT))
    w.tandem_prepare("7")  # no such version
    status = wait_prepared(w)
    assert status["prepared"] is None and "7" in status["error"]
    assert w.tandem_apply()["applied"] is False
