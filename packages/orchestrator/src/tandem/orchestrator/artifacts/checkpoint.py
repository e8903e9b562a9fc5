"""Crash-safe checkpoints for resuming a run exactly where it stopped.

A checkpoint holds the model, the optimizer, the policy version, the task cursor, every
RNG state and any extra loop state. It is written into a temporary directory, fsynced, then
renamed into place, and only then does the ``latest`` pointer move (itself replaced
atomically), so a process killed at any instant (SIGKILL included) leaves the previous
checkpoint loadable and never a half-written one.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import numpy as np
import structlog
import torch

log = structlog.get_logger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or does not match what is being restored."""


class CheckpointMeta(msgspec.Struct, kw_only=True):
    """What a checkpoint says about itself (``meta.json``, written last inside it)."""

    step: int
    policy_version: int
    task_cursor: int
    extra: dict[str, Any] = {}


def capture_rng() -> dict[str, Any]:
    """The state of every RNG a run draws from (Python, numpy, torch CPU and CUDA)."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class CheckpointManager:
    """Saves ``step_NNNNNNNN`` directories under ``root`` and keeps the newest ``keep``."""

    def __init__(self, root: str | Path, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.root = Path(root)
        self.keep = keep

    def _dir(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def save(
        self,
        step: int,
        *,
        model_state: dict[str, torch.Tensor],
        optimizer_state: dict[str, Any] | None,
        policy_version: int,
        task_cursor: int,
        extra: dict[str, Any] | None = None,
    ) -> Path:
        """Write a checkpoint for ``step`` atomically and move ``latest`` to it."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self._dir(step)
        tmp = self.root / f".tmp-{final.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        torch.save(model_state, tmp / "model.pt")
        if optimizer_state is not None:
            torch.save(optimizer_state, tmp / "optimizer.pt")
        torch.save(capture_rng(), tmp / "rng.pt")
        meta = CheckpointMeta(
            step=step, policy_version=policy_version, task_cursor=task_cursor, extra=extra or {}
        )
        _write_file(tmp / "meta.json", msgspec.json.encode(meta))
        for name in ("model.pt", "optimizer.pt", "rng.pt"):
            if (tmp / name).exists():
                with open(tmp / name, "rb") as f:
                    os.fsync(f.fileno())
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        pointer_tmp = self.root / f".latest-{os.getpid()}"
        _write_file(pointer_tmp, json.dumps({"step": step}).encode())
        os.replace(pointer_tmp, self.root / "latest")
        _fsync_dir(self.root)
        self._prune()
        log.info("checkpoint saved", step=step, path=str(final))
        return final

    def _prune(self) -> None:
        steps = sorted(self.steps())
        for step in steps[: -self.keep]:
            shutil.rmtree(self._dir(step), ignore_errors=True)

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints present (those whose rename happened)."""
        if not self.root.is_dir():
            return []
        return sorted(
            int(p.name.removeprefix("step_"))
            for p in self.root.glob("step_*")
            if p.is_dir() and (p / "meta.json").is_file()
        )

    def latest_step(self) -> int | None:
        """The step ``latest`` points to, or None when there is no checkpoint yet."""
        pointer = self.root / "latest"
        if not pointer.is_file():
            return None
        try:
            step = int(json.loads(pointer.read_text())["step"])
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{pointer} is corrupt ({e}); remove it to start over") from None
        if not (self._dir(step) / "meta.json").is_file():
            raise CheckpointError(
                f"{pointer} points to step {step}, but {self._dir(step)} is incomplete"
            )
        return step

    def load(self, step: int | None = None, *, restore_rngs: bool = True) -> Checkpoint:
        """The checkpoint of ``step`` (default: latest), with the RNGs restored from it."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint under {self.root}")
        path = self._dir(step)
        if not (path / "meta.json").is_file():
            raise CheckpointError(f"checkpoint {path} does not exist or is incomplete")
        meta = msgspec.json.decode((path / "meta.json").read_bytes(), type=CheckpointMeta)
        model_state = torch.load(path / "model.pt", map_location="cpu", weights_only=True)
        optimizer_state = None
        if (path / "optimizer.pt").is_file():
            optimizer_state = torch.load(
                path / "optimizer.pt", map_location="cpu", weights_only=True
            )
        if restore_rngs:
            restore_rng(torch.load(path / "rng.pt", weights_only=False))
        log.info("checkpoint loaded", step=step, policy_version=meta.policy_version)
        return Checkpoint(path, meta, model_state, optimizer_state)


class Checkpoint(NamedTuple):
    """A loaded checkpoint: where it is, what it says, the weights and optimizer state."""

    path: Path
    meta: CheckpointMeta
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any] | None


def load_weights(model: torch.nn.Module, checkpoint: Checkpoint) -> None:
    """Restore ``model``'s weights from ``checkpoint`` (a clear error if they do not fit)."""
    try:
        model.load_state_dict(checkpoint.model_state)
    except RuntimeError as e:
        raise CheckpointError(
            f"checkpoint {checkpoint.path} does not fit this model: {e}"
        ) from None


def optimizer_state(checkpoint: Checkpoint) -> dict[str, Any]:
    """The checkpoint's optimizer state (a clear error if it was saved without one)."""
    if checkpoint.optimizer_state is None:
        raise CheckpointError(f"checkpoint {checkpoint.path} has no optimizer state")
    return checkpoint.optimizer_state
