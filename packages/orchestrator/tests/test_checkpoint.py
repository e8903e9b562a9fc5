"""Checkpoints: exact restore of weights, optimizer and RNGs; a kill mid-save loses nothing."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from tandem.orchestrator.artifacts.checkpoint import (
    CheckpointError,
    CheckpointManager,
    load_weights,
    optimizer_state,
)


def _model_and_opt(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        x = torch.randn(16, 4)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_resume_continues_bit_exactly(tmp_path: Path) -> None:
    # Reference: 3 steps, a checkpoint, 3 more steps (the data draws come from torch's RNG).
    model, opt = _model_and_opt(0)
    _train(model, opt, 3)
    ckpt = CheckpointManager(tmp_path)
    ckpt.save(
        3,
        model_state=model.state_dict(),
        optimizer_state=opt.state_dict(),
        policy_version=3,
        task_cursor=48,
        extra={"k": 1},
    )
    _train(model, opt, 3)
    ref = {k: v.clone() for k, v in model.state_dict().items()}

    # Restart from the checkpoint in a fresh model with a different init and RNG state.
    model2, opt2 = _model_and_opt(123)
    loaded = ckpt.load()
    load_weights(model2, loaded)
    opt2.load_state_dict(optimizer_state(loaded))
    meta = loaded.meta
    assert (meta.step, meta.policy_version, meta.task_cursor, meta.extra) == (3, 3, 48, {"k": 1})
    _train(model2, opt2, 3)
    for k, v in model2.state_dict().items():
        assert torch.equal(v, ref[k]), k


def test_rng_states_are_restored(tmp_path: Path) -> None:
    model, _ = _model_and_opt(0)
    random.seed(1)
    np.random.seed(1)
    ckpt = CheckpointManager(tmp_path)
    ckpt.save(
        1, model_state=model.state_dict(), optimizer_state=None, policy_version=1, task_cursor=0
    )
    draws = (random.random(), float(np.random.rand()), torch.rand(1).item())
    random.seed(2)
    np.random.seed(2)
    torch.manual_seed(2)
    assert (random.random(), float(np.random.rand()), torch.rand(1).item()) != draws
    ckpt.load()
    assert (random.random(), float(np.random.rand()), torch.rand(1).item()) == draws


def test_keeps_newest_and_latest_pointer(tmp_path: Path) -> None:
    model, opt = _model_and_opt(0)
    ckpt = CheckpointManager(tmp_path, keep=2)
    assert ckpt.latest_step() is None
    for step in (1, 2, 3):
        ckpt.save(
            step,
            model_state=model.state_dict(),
            optimizer_state=opt.state_dict(),
            policy_version=step,
            task_cursor=0,
        )
    assert ckpt.steps() == [2, 3]
    assert ckpt.latest_step() == 3


def test_errors_are_clear(tmp_path: Path) -> None:
    model, _ = _model_and_opt(0)
    ckpt = CheckpointManager(tmp_path)
    with pytest.raises(CheckpointError, match="no checkpoint"):
        ckpt.load()
    ckpt.save(
        1, model_state=model.state_dict(), optimizer_state=None, policy_version=1, task_cursor=0
    )
    with pytest.raises(CheckpointError, match="no optimizer state"):
        optimizer_state(ckpt.load())
    with pytest.raises(CheckpointError, match="does not fit this model"):
        load_weights(torch.nn.Linear(3, 3), ckpt.load())
    (tmp_path / "latest").write_text('{"step": 7}')
    with pytest.raises(CheckpointError, match="incomplete"):
        ckpt.latest_step()


def test_sigkill_during_save_leaves_previous_checkpoint(tmp_path: Path) -> None:
    """A writer killed while saving a large checkpoint never corrupts the last good one."""
    script = textwrap.dedent(
        f"""
        import sys, torch
        from tandem.orchestrator.artifacts.checkpoint import CheckpointManager
        ckpt = CheckpointManager({str(tmp_path)!r}, keep=5)
        small = torch.nn.Linear(2, 2)
        ckpt.save(1, model_state=small.state_dict(), optimizer_state=None, policy_version=1, task_cursor=10)
        print("saved", flush=True)
        big = torch.nn.Linear(2048, 2048)
        for step in range(2, 1000):
            ckpt.save(step, model_state=big.state_dict(), optimizer_state=None, policy_version=step, task_cursor=step)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:  # unconfigured structlog also prints to stdout
        if line.strip() == "saved":
            break
    else:
        pytest.fail("the writer exited before its first checkpoint")
    # Kill as soon as a temporary directory of a later save exists.
    for _ in range(2000):
        if any(p.name.startswith(".tmp-") for p in tmp_path.iterdir()):
            break
        os.sched_yield()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    ckpt = CheckpointManager(tmp_path)
    step = ckpt.latest_step()
    assert step is not None and step >= 1
    model = torch.nn.Linear(2, 2) if step == 1 else torch.nn.Linear(2048, 2048)
    loaded = ckpt.load(restore_rngs=False)
    load_weights(model, loaded)
    meta = loaded.meta
    assert meta.step == step and meta.task_cursor == (10 if step == 1 else step)
