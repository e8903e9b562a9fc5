"""A stop signal ends an RL run at a step with a checkpoint, and the run resumes from it.

The signal arrives while step 1 trains (sent from the step hook, twice at once as Ctrl-C on
`uv run` delivers it; the copy is the same request, not a second one): that step finishes, a
checkpoint of it is written although ``checkpoint_every`` would not write one, and the run
returns. A second run in the same directory resumes after it; the signal handlers are gone
once the run returns. A signal while the run waits for groups abandons that step.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from rl_helpers import parity, tiny_run

from tandem.orchestrator.artifacts.checkpoint import CheckpointManager
from tandem.orchestrator.artifacts.metrics import read_metrics
from tandem.orchestrator.config import RLConfig
from tandem.orchestrator.rl.hooks import RunHooks

RL = RLConfig(
    mode="sync", steps=3, group_size=2, groups_per_step=1, rollout_workers=2, checkpoint_every=10
)


def _hooks(stopped: list[tuple[int, int]], send_at: int | None) -> RunHooks:
    def on_step(step: int, _: dict) -> None:
        if step == send_at:  # twice, as `uv run` forwards the Ctrl-C this process also got
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)

    return RunHooks(
        reward=parity,
        on_step=on_step,
        stop_signals=(signal.SIGINT, signal.SIGTERM),
        on_stop=lambda sig, steps: stopped.append((sig, steps)),
    )


def test_sigint_finishes_the_step_checkpoints_and_the_rerun_resumes(tmp_path: Path) -> None:
    stopped: list[tuple[int, int]] = []
    summary = tiny_run(tmp_path, RL, _hooks(stopped, send_at=1)).run()
    assert stopped == [(signal.SIGINT, 2)]  # steps 0 and 1 done
    assert summary.steps_done == 2
    assert CheckpointManager(tmp_path / "checkpoints").latest_step() == 2
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers removed

    resumed: list[tuple[int, int]] = []
    summary = tiny_run(tmp_path, RL, _hooks(resumed, send_at=None)).run()
    assert resumed == [] and summary.steps_done == 3
    assert [m["step"] for m in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2]


def test_sigterm_while_waiting_for_groups_abandons_the_step(tmp_path: Path) -> None:
    """No step has finished: nothing to checkpoint, and the run returns at once."""
    stopped: list[tuple[int, int]] = []
    hooks = _hooks(stopped, send_at=None)

    sent: list[bool] = []

    def reward(sample) -> float:  # called as the first group forms: the step is waiting
        if not sent:  # once: a second signal quits at once
            sent.append(True)
            os.kill(os.getpid(), signal.SIGTERM)
        return 0.0  # equal rewards: no group would ever complete the step

    hooks.reward = reward
    summary = tiny_run(tmp_path, RL, hooks).run()
    assert stopped == [(signal.SIGTERM, 0)] and summary.steps_done == 0
    assert CheckpointManager(tmp_path / "checkpoints").latest_step() is None
