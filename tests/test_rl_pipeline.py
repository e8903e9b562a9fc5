"""End-to-end wiring of the async RL pipeline on a tiny config (real sandboxed episodes).

Checks what the pieces promise together: policy versions advance, every version is published
through delta-sync and the engine's weights equal the trainer's bit for bit after each pull,
groups older than the staleness bound are dropped and never trained on, rollout and trainer
log-probs agree bit for bit on same-version samples, and a run killed with SIGKILL resumes
from its last checkpoint with no repeated or skipped step.

The episodes are real (sandbox, hidden tests); the reward is a parity of the generated
tokens (`rl_helpers`).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from rl_helpers import ENGINE, TINY, WeightRecorder, parity, tiny_run

from tandem.agent_env import EnvConfig
from tandem.delta_sync import LocalStore, StoreError
from tandem.orchestrator.artifacts.metrics import read_metrics
from tandem.orchestrator.backends import local as local_backend
from tandem.orchestrator.config import CurriculumConfig, RLConfig, TaskConfig
from tandem.orchestrator.rl import signal as signal_module
from tandem.orchestrator.rl.hooks import RunHooks
from tandem.orchestrator.rollout import group as group_module
from tandem.orchestrator.rollout.tasks import TaskSource
from tandem.orchestrator.runtime.threads import torch_threads


def test_async_steps_versions_deltas_staleness(tmp_path: Path) -> None:
    sync = WeightRecorder()
    group_versions: list[int] = []
    engine_threads: list[int] = []

    def on_apply(version: int, state) -> None:
        engine_threads.append(torch.get_num_threads())  # in the engine's thread
        sync.on_apply(version, state)

    hooks = RunHooks(
        on_publish=sync.on_publish,
        on_engine_update=on_apply,
        on_group=lambda g: group_versions.append(g.policy_version),
        reward=parity,
    )
    rl = RLConfig(
        mode="async",
        steps=3,
        group_size=3,
        groups_per_step=1,
        max_staleness=0,
        max_ahead=3,
        rollout_workers=3,
        checkpoint_every=3,
        torch_threads=1,
        trainer_threads_alone=2,  # the trainer takes 2 while the engine has nothing to play
    )
    with torch_threads(2):  # a count other than the run's, whatever this machine's default
        summary = tiny_run(tmp_path, rl, hooks, check_rows=2).run()
        assert torch.get_num_threads() == 2  # given back after the run

    assert summary.steps_done == 3 and summary.policy_version == 3
    assert engine_threads and set(engine_threads) == {1}
    assert sorted(sync.published) == [1, 2, 3]
    applied = sync.applied
    assert applied and all(applied.values()), applied  # engine == trainer, bit for bit
    assert set(applied) <= {1, 2, 3} and min(applied) == 1
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert [r["policy_version"] for r in records] == [1.0, 2.0, 3.0]
    for r in records:
        assert r["sync_bytes"] > 0 and r["staleness_max"] == 0.0
        assert r["routing_agreement_replay"] == 1.0
        if r.get("mismatch_tokens"):
            assert r["mismatch_max_abs"] == 0.0
        assert 0 <= r["trainer_alone_s"] <= r["train_s"]
    # Groups were produced at version 0 beyond what step 0 could use: max_staleness=0 drops them.
    assert group_versions.count(0) >= 2
    assert summary.dropped_stale >= 1
    assert summary.staleness_histogram.keys() == {0}
    # the engine decoded for part of the time it was up, and the step lines say how long
    assert 0 < summary.engine_busy_s < summary.engine_s
    busy = [r["engine_busy_s"] for r in records]
    assert busy == sorted(busy) and 0 < busy[-1] <= summary.engine_busy_s


def test_pipelined_steps_train_on_the_version_before_and_repeat_bit_for_bit(
    tmp_path: Path,
) -> None:
    """``pipelined``: step k+1's groups play on version k while step k trains, so steps 0 and
    1 train on version 0's groups and every later step on the version just before the
    trainer's (staleness 1); the schedule does not depend on timing, so a second run gives
    the same weights bit for bit."""
    from tandem.orchestrator.training.weights import state_for_sync, weights_equal

    rl = RLConfig(mode="pipelined", steps=4, group_size=3, groups_per_step=2, checkpoint_every=9)
    runs = []
    for name in ("a", "b"):
        run = tiny_run(tmp_path / name, rl, RunHooks(reward=parity))
        summary = run.run()
        assert summary.steps_done == 4 and summary.policy_version == 4
        runs.append(run)
    assert weights_equal(state_for_sync(runs[0].policy), state_for_sync(runs[1].policy))
    for name in ("a", "b"):
        records = read_metrics(tmp_path / name / "metrics.jsonl")
        # cumulative over the run: the trainer's version at step k is k
        assert [r["staleness_histogram"] for r in records] == [
            {"0": 2},
            {"0": 2, "1": 2},
            {"0": 2, "1": 4},
            {"0": 2, "1": 6},
        ]
        assert [r["engine_version"] for r in records] == [0, 1, 2, 3]  # a step behind


_SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from tandem.moe_determinism import MoEConfig
    from tandem.orchestrator import RunConfig, RunHooks, RunSettings, build_model, reinforce
    from tandem.orchestrator.config import EngineConfig, RayConfig, RLConfig, TrainerConfig
    from tandem.agent_env import EnvConfig
    from tandem.orchestrator.inference.tokenizer import ByteTokenizer

    run_dir = Path(sys.argv[1])
    config = RunConfig(
        run=RunSettings(name=run_dir.name, output_dir=str(run_dir.parent)),
        model=MoEConfig(**{model!r}),
        rl=RLConfig(mode="sync", steps=4, group_size=3, groups_per_step=2, checkpoint_every=1, {backend}),
        trainer=TrainerConfig(lr=1e-2, routing_check_rows=0, processes={processes}),
        engine=EngineConfig(max_slots=8, max_len=1024, max_new_tokens=6),
        env=EnvConfig(max_turns=1, allow_unsandboxed=True),
    )
    s = reinforce(
        build_model(config.model, ByteTokenizer()),
        config,
        run_dir=run_dir,
        task_offset=0,
        hooks=RunHooks(reward=lambda s: float(sum(s.tokens[-len(s.tokens) // 3:]) % 2)),
    )
    print("DONE", s.steps_done, s.policy_version, flush=True)
    """
)


@pytest.mark.parametrize(
    ("backend", "processes"),
    [("local", 1), ('backend="ray", ray=RayConfig(workers=1, num_cpus=3)', 2)],
    ids=["local", "ray-2-ranks"],
)
def test_resume_after_sigkill(tmp_path: Path, backend: str, processes: int) -> None:
    """The driver (with its Ray cluster, rollout actors and trainer ranks on ``ray``) is
    killed; the same command resumes from the last checkpoint."""
    import msgspec

    script = tmp_path / "run.py"
    backend = "" if backend == "local" else backend
    script.write_text(
        _SCRIPT.format(model=msgspec.to_builtins(TINY), backend=backend, processes=processes)
    )
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    first_log = tmp_path / "first.log"  # a file, not a pipe nobody reads until the end
    with first_log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, str(script), str(run_dir)], env=env, stdout=out, stderr=out
        )
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.monotonic() + 560  # both runs; pytest's own timeout is 600 s
    while time.monotonic() < deadline and proc.poll() is None:
        if latest.is_file() and json.loads(latest.read_text())["step"] >= 2:
            break
        time.sleep(0.05)
    if proc.poll() is not None or time.monotonic() >= deadline:
        proc.kill()
        proc.wait()
        printed = first_log.read_text(errors="replace")
        pytest.fail(f"the first run ended or stalled before step 2; it printed:\n{printed[-6000:]}")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = json.loads(latest.read_text())["step"]
    assert 2 <= killed_at < 4

    try:  # within the test's own timeout, so a stuck resume shows what it printed
        done = subprocess.run(
            [sys.executable, str(script), str(run_dir)],
            env=env,
            capture_output=True,
            text=True,
            timeout=max(60.0, deadline - time.monotonic() - 30),
        )
    except subprocess.TimeoutExpired as e:
        out = [
            x.decode(errors="replace") if isinstance(x, bytes) else x or ""
            for x in (e.stdout, e.stderr)
        ]
        pytest.fail(
            f"the resumed run did not finish; it printed:\n{out[0][-4000:]}{out[1][-4000:]}"
        )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "DONE 4 4" in done.stdout
    assert "rl.resumed" in done.stdout + done.stderr
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]  # none repeated, none skipped
    assert [r["policy_version"] for r in records] == [1.0, 2.0, 3.0, 4.0]
    meta = json.loads((run_dir / "checkpoints" / "step_00000004" / "meta.json").read_text())
    assert meta["policy_version"] == 4 and meta["extra"]["stream"] == 1
    assert meta["task_cursor"] >= 4


class FlakyStore(LocalStore):
    """A LocalStore that fails every request while `down` is set (an object-store outage)."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.down = threading.Event()
        self.refused = 0

    def _check(self, key: str) -> None:
        if self.down.is_set():
            self.refused += 1
            raise StoreError(f"{key!r}: connection refused (outage)")

    def get(self, key: str) -> bytes:
        self._check(key)
        return super().get(key)

    def put(self, key: str, data: bytes) -> None:
        self._check(key)
        super().put(key, data)

    def exists(self, key: str) -> bool:
        self._check(key)
        return super().exists(key)


def test_store_outage_delays_sync_without_stopping_rollouts(tmp_path: Path, monkeypatch) -> None:
    stores: list[FlakyStore] = []

    def flaky_stream_store(base: str, run_dir: Path, stream: int) -> FlakyStore:
        stores.append(FlakyStore(str(run_dir / "weights" / f"stream-{stream:04d}")))
        return stores[-1]

    monkeypatch.setattr(local_backend, "stream_store", flaky_stream_store)
    sync = WeightRecorder()
    during_outage: list[int] = []  # policy versions of groups finished while the store was down

    def on_step(step: int, stats: dict) -> None:
        if step == 0:  # the store goes down for a few seconds after the first step
            stores[0].down.set()
            threading.Timer(4.0, stores[0].down.clear).start()

    def on_group(group) -> None:
        if stores and stores[0].down.is_set():
            during_outage.append(group.policy_version)

    hooks = RunHooks(
        on_publish=sync.on_publish,
        on_engine_update=sync.on_apply,
        on_step=on_step,
        on_group=on_group,
        reward=parity,
    )
    rl = RLConfig(
        mode="async", steps=4, group_size=3, groups_per_step=1, max_staleness=1,
        rollout_workers=3, checkpoint_every=4,
    )  # fmt: skip
    run = tiny_run(tmp_path, rl, hooks)
    summary = run.run()

    assert summary.steps_done == 4 and summary.policy_version == 4
    assert stores[0].refused > 0
    assert during_outage, "rollouts stopped while the store was down"
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert any(r.get("publish_failed") for r in records)
    assert records[-1]["publish_failures"] >= 1
    # after the outage the engine caught up, and every version it applied is the trainer's
    assert sync.applied and all(sync.applied.values()), sync.applied
    assert max(sync.applied) >= 2
    assert max(sync.published) > 1  # a version was published after the outage


def test_an_episode_stuck_past_its_budget_is_cut_and_counted(tmp_path: Path, monkeypatch) -> None:
    real_run_episode = group_module.run_token_episode
    stuck = {"started": 0, "released": 0}

    async def run_token_episode(server, *args, **kwargs):
        if stuck["started"] == 0:  # the very first episode hangs (a stalled sandbox, say)
            stuck["started"] += 1
            slot = await server.acquire()
            try:
                await asyncio.Event().wait()
            finally:
                server.release(slot)
                stuck["released"] += 1
        return await real_run_episode(server, *args, **kwargs)

    monkeypatch.setattr(group_module, "run_token_episode", run_token_episode)
    groups: list[int] = []
    rl = RLConfig(
        mode="async",
        steps=2,
        group_size=3,
        groups_per_step=1,
        max_staleness=1,
        rollout_workers=1,  # the one worker is held by the stuck group until it is cut
        checkpoint_every=2,
    )
    env = EnvConfig(max_turns=1, allow_unsandboxed=True, episode_wall_s=2.0, grade_timeout_s=1.0)
    hooks = RunHooks(reward=parity, on_group=lambda g: groups.append(len(g.samples)))
    run = tiny_run(tmp_path, rl, hooks, env=env)
    summary = run.run()
    assert summary.steps_done == 2
    assert stuck == {"started": 1, "released": 1}  # cut, and its engine slot given back
    assert read_metrics(tmp_path / "metrics.jsonl")[-1]["episodes_cut"] == 1
    assert groups and all(n == 3 for n in groups)  # no partial group reached the trainer
    assert run.rollouts.engine.free_slots == ENGINE.max_slots


def test_more_trainer_ranks_than_groups_is_refused_at_start(tmp_path: Path) -> None:
    from tandem.orchestrator.config import ConfigValueError

    rl = RLConfig(mode="sync", steps=1, group_size=3, groups_per_step=2)
    with pytest.raises(ConfigValueError, match=r"trainer\.processes: 3 ranks for rl\.groups_per"):
        tiny_run(tmp_path, rl, RunHooks(), processes=3)


def test_a_long_run_of_equal_reward_groups_is_reported(tmp_path: Path, monkeypatch) -> None:
    every = 4
    monkeypatch.setattr(signal_module, "NO_SIGNAL_REPORT_EVERY", every)
    warnings: list[dict] = []

    class Log:  # the run's logger (structlog may cache loggers, so it is swapped, not captured)
        def warning(self, event: str, **kw) -> None:
            if event == "rl.no_signal":
                warnings.append(kw)

        def __getattr__(self, name: str):
            return lambda *a, **kw: None

    monkeypatch.setattr(signal_module, "log", Log())
    rl = RLConfig(mode="sync", steps=1, group_size=2, groups_per_step=1, checkpoint_every=5)
    scored = []

    def reward(sample) -> float:  # every sample rewarded for the first `every` groups
        scored.append(sample)
        return 1.0 if len(scored) <= every * rl.group_size else parity(sample)

    summary = tiny_run(tmp_path, rl, RunHooks(reward=reward)).run()
    assert summary.steps_done == 1 and summary.filtered_equal >= every
    assert warnings[0]["groups_in_a_row"] == every
    assert warnings[0]["all_rewarded"] == every and warnings[0]["all_unrewarded"] == 0
    assert len(warnings) == summary.filtered_equal // every  # one per full run of `every`


def test_the_curriculum_passes_over_tasks_of_a_category_without_signal(tmp_path: Path) -> None:
    """Tasks of one function always get reward 1 (no GRPO signal); once its last group says
    so, the cursor passes over most of its tasks, and only over those; the passes are counted
    in the metrics and the run still makes its steps."""
    source = TaskSource(TaskConfig(functions=["gcd", "digit_sum"]), 1)
    function = {t.id: t.metadata["function"] for t in source.take(0, 300)}
    played: list[str] = []

    def reward(sample) -> float:  # called for a group's samples in turn: 1, 0, 1 elsewhere
        played.append(sample.task_id)
        return 1.0 if function[sample.task_id] == "gcd" else float(len(played) % 2)

    rl = RLConfig(
        mode="sync",
        steps=3,
        group_size=3,
        groups_per_step=2,
        checkpoint_every=9,
        curriculum=CurriculumConfig(enabled=True, keys=["function"], window=1, keep=0.2),
    )
    run = tiny_run(tmp_path, rl, RunHooks(reward=reward), tasks=source)
    summary = run.run()
    assert summary.steps_done == 3
    passed = [t.id for t in source.take(0, run.cursor.cursor) if t.id not in set(played)]
    assert passed and len(passed) == run.cursor.skipped
    assert {function[i] for i in passed} == {"gcd"}
    gcd_played = {i for i in played if function[i] == "gcd"}
    assert len(gcd_played) < len(passed)  # most of that function's tasks were passed over
    assert read_metrics(tmp_path / "metrics.jsonl")[-1]["tasks_skipped"] == len(passed)
