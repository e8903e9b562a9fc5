"""Held-out evaluation end to end (engine, sandbox, grading) and its per-category table."""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
from rl_helpers import ENGINE, ENV, TINY

from tandem.app.demo_report import CATEGORY_COLUMNS, category_rows, losses_line
from tandem.orchestrator import RunConfig, build_model, evaluate_policy
from tandem.orchestrator.artifacts.report import markdown_table
from tandem.orchestrator.config import EvalConfig, TaskConfig
from tandem.orchestrator.eval.passk import CategoryScore, EvalResult, summarize
from tandem.orchestrator.eval.replicas import ReplicaFailed, _check_alive, play_on_replicas
from tandem.orchestrator.inference.tokenizer import ByteTokenizer
from tandem.orchestrator.rollout.tasks import TaskSource, task_category


def test_evaluation_breaks_pass_at_1_down_by_the_tasks_categories() -> None:
    tasks = TaskConfig(functions=["gcd", "digit_sum"], functions_per_repo=1, eval_seed=77)
    config = RunConfig(
        model=TINY, tasks=tasks, env=ENV, engine=ENGINE, eval=EvalConfig(tasks=6, samples=2)
    )
    result = evaluate_policy(build_model(TINY, ByteTokenizer()), config)
    held_out = TaskSource(tasks, tasks.eval_seed).take(0, 6)
    expected = Counter(f"{t.metadata['function']}/{t.metadata['bug_kind']}" for t in held_out)
    assert {c: s.tasks for c, s in result.by_category.items()} == dict(expected)
    total = sum(s.tasks * s.pass_at_1 for s in result.by_category.values()) / 6
    assert total == pytest.approx(result.pass_at[1])


def _result(categories: list[str], solved: list[int]) -> EvalResult:
    """A result of 4 samples per task: task i of ``categories[i]``, ``solved[i]`` solved."""
    scores: dict[str, list[float]] = {}
    for c, k in zip(categories, solved, strict=True):
        scores.setdefault(c, []).append(k / 4)
    return EvalResult(
        tasks=len(solved),
        samples_per_task=4,
        pass_at={1: sum(solved) / (4 * len(solved))},
        mean_reward=0.0,
        format_error_rate=0.0,
        mean_turns=2.0,
        infra_faults=0,
        by_category={c: CategoryScore(len(v), sum(v) / len(v)) for c, v in sorted(scores.items())},
        solved=solved,
        categories=categories,
    )


def _interval(diffs: list[float]) -> str:
    """The normal 95% interval of a mean, in points, computed with the statistics module."""
    import statistics

    half = 1.96 * statistics.stdev(diffs) / len(diffs) ** 0.5
    mean = statistics.fmean(diffs)
    return f"{100 * (mean - half):+.1f} to {100 * (mean + half):+.1f}"


CATS = ["gcd/off_by_one"] * 3 + ["gcd/swapped_arguments"] * 2


def test_demo_category_table_gives_the_change_per_category() -> None:
    before = _result(CATS, [1, 1, 1, 4, 4])
    after = _result(CATS, [3, 2, 4, 2, 2])
    training = {"gcd/off_by_one": {"groups": 7, "reward": 0.625}}
    rows = category_rows(before, after, training)
    assert rows == [
        (
            "gcd/off_by_one",
            "3",
            "0.25",
            "0.75",
            "+50.0",
            _interval([0.5, 0.25, 0.75]),
            "0.62 (7 groups)",
        ),
        ("gcd/swapped_arguments", "2", "1.00", "0.50", "-50.0", "-50.0 to -50.0", "n/a"),
    ]
    lines = markdown_table(rows, CATEGORY_COLUMNS).splitlines()
    assert len(lines) == 4
    assert lines[1].count("|") == len(CATEGORY_COLUMNS) + 1
    assert lines[2].startswith("| gcd/off_by_one        | 3 | 0.25 | 0.75 | +50.0 |")


def test_categories_that_lost_more_than_ten_points_are_named_with_their_interval() -> None:
    before = _result(CATS, [1, 1, 1, 4, 4])
    lost = _result(CATS, [3, 2, 4, 4, 2])  # swapped arguments: -1.0 and -0.5 -> -25 points
    line = losses_line(before, lost)
    assert line == f"LOST: gcd/swapped_arguments -25.0 ({_interval([0.0, -0.5])}, 2 tasks)"
    held = _result(CATS, [3, 2, 4, 4, 3])  # -12.5 points: still more than 10
    assert losses_line(before, held).startswith("LOST: gcd/swapped_arguments -12.5")
    kept = _result(CATS, [3, 2, 4, 4, 4])
    assert losses_line(before, kept) == "none"


def test_engine_replicas_play_every_episode_as_one_engine_does() -> None:
    """Two replica processes (one torch thread each) share the tasks; every episode still
    samples the same tokens with the same log-probs as on one engine in this process (two
    torch threads), so the evaluation is the same."""
    tasks = TaskConfig(functions=["gcd", "digit_sum"], functions_per_repo=1, eval_seed=78)
    held_out = TaskSource(tasks, tasks.eval_seed).take(0, 5)
    model = build_model(TINY, ByteTokenizer())
    engine = msgspec.structs.replace(ENGINE, max_slots=3)  # fewer slots than episodes
    config = RunConfig(
        model=TINY, tasks=tasks, env=ENV, engine=engine, eval=EvalConfig(tasks=5, samples=2)
    )
    finished = []
    played = [
        play_on_replicas(
            model,
            config,
            held_out,
            samples=2,
            replicas=replicas,
            on_sample=functools.partial(finished.append, replicas),
        )
        for replicas in (1, 2)
    ]
    one, two = (
        [[(s.task_id, s.tokens, s.logprobs, s.turns) for s in samples] for samples in per_task]
        for per_task in played
    )
    assert len(one) == 5 and all(len(samples) == 2 for samples in one)
    assert [task[0][0] for task in one] == [t.id for t in held_out]
    assert one == two
    assert len({tuple(tokens) for task in one for _, tokens, _, _ in task}) > 1
    assert finished.count(1) == finished.count(2) == 10
    on_two = evaluate_policy(
        model, msgspec.structs.replace(config, eval=EvalConfig(tasks=5, samples=2, engines=2))
    )
    assert on_two == summarize(played[0], (1,), [task_category(t) for t in held_out])


def test_a_failing_replica_raises_its_traceback(tmp_path: Path) -> None:
    """A replica that raises stops the evaluation with the replica's own traceback."""
    (tmp_path / "tokenizer.json").write_text("{not json")
    model = build_model(copy.copy(TINY), ByteTokenizer())
    model.config.path = str(tmp_path)  # the replica reads its tokenizer from here
    tasks = TaskConfig(functions=["gcd"], functions_per_repo=1, eval_seed=79)
    config = RunConfig(model=TINY, tasks=tasks, env=ENV, engine=ENGINE)
    held_out = TaskSource(tasks, tasks.eval_seed).take(0, 2)
    with pytest.raises(ReplicaFailed, match=r"(?s)evaluation replica \d failed:.*Traceback"):
        play_on_replicas(model, config, held_out, samples=1, replicas=2)


def test_a_replica_gone_without_its_samples_is_an_error() -> None:
    """Killed: an error at once; exited cleanly without sending: after one more quiet poll
    (what it sent before exiting would have arrived by then)."""
    running, killed, exited = (SimpleNamespace(exitcode=c) for c in (None, -9, 0))
    gone: set[int] = set()
    _check_alive([running, exited], {}, gone)  # type: ignore[list-item]
    assert gone == {1}
    with pytest.raises(ReplicaFailed, match="replica 1 exited without sending"):
        _check_alive([running, exited], {}, gone)  # type: ignore[list-item]
    _check_alive([running, exited], {1: []}, set())  # type: ignore[list-item]
    with pytest.raises(ReplicaFailed, match="replica 0 exited with code -9"):
        _check_alive([killed], {}, set())  # type: ignore[list-item]


_KILLED_PARENT = """
import sys
sys.path.insert(0, {tests!r})
from rl_helpers import ENGINE, ENV, TINY
from tandem.orchestrator import RunConfig, build_model
from tandem.orchestrator.config import TaskConfig
from tandem.orchestrator.eval.replicas import play_on_replicas
from tandem.orchestrator.inference.tokenizer import ByteTokenizer
from tandem.orchestrator.rollout.tasks import TaskSource

if __name__ == "__main__":
    tasks = TaskConfig(functions=["gcd"], functions_per_repo=1, eval_seed=80)
    config = RunConfig(model=TINY, tasks=tasks, env=ENV, engine=ENGINE)
    held_out = TaskSource(tasks, tasks.eval_seed).take(0, 400)
    play_on_replicas(build_model(TINY, ByteTokenizer()), config, held_out, samples=1, replicas=2)
"""


def _processes() -> dict[tuple[int, int], int]:
    """Every running process (not a zombie), as (pid, start time), and its parent's id,
    from /proc: the start time tells a process from a later one given the same pid."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue  # gone meanwhile
            if fields[0] != "Z":
                out[(int(entry.name), int(fields[19]))] = int(fields[1])
    return out


def _descendants(pid: int) -> set[tuple[int, int]]:
    procs = _processes()
    found: set[tuple[int, int]] = set()
    frontier = {pid}
    while frontier:
        new = {p for p, parent in procs.items() if parent in frontier} - found
        found |= new
        frontier = {p[0] for p in new}
    return found


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process tree in /proc")
def test_replicas_end_when_their_parent_is_killed(tmp_path: Path) -> None:
    """A killed evaluation leaves no replica (nor any sandbox a replica started) running."""
    script = tmp_path / "evaluate.py"
    script.write_text(_KILLED_PARENT.format(tests=str(Path(__file__).parent)))
    with (tmp_path / "log").open("wb") as log:
        parent = subprocess.Popen([sys.executable, str(script)], stdout=log, stderr=log)
    replicas: set[tuple[int, int]] = set()
    try:
        deadline = time.monotonic() + 120
        while len(replicas) < 2 and parent.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
            replicas = {p for p in _descendants(parent.pid) if b"spawn_main" in _cmdline(p[0])}
        assert len(replicas) == 2, (tmp_path / "log").read_text()[-3000:]
        while not all(_descendants(r[0]) for r in replicas) and time.monotonic() < deadline:
            time.sleep(0.2)  # until every replica has started its sandbox
        tree = _descendants(parent.pid)
        assert len(tree) > len(replicas), "the replicas started no sandbox"
        parent.kill()
        parent.wait(timeout=10)
        deadline = time.monotonic() + 15
        while tree & _processes().keys() and time.monotonic() < deadline:
            time.sleep(0.2)
        left = tree & _processes().keys()
        assert not left, f"still running after their parent was killed: {left}"
    finally:
        parent.kill()
        for pid, _ in replicas & _processes().keys():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_an_evaluation_beside_training_scores_the_policy_it_was_given(tmp_path: Path) -> None:
    """`EvalBeside` plays a copy of the policy in engine processes that run only on idle
    cores while the caller changes the original: its result is the evaluation of the policy
    as it was (the original, changed, would fail: its tokenizer file is broken)."""
    import multiprocessing

    import torch

    from tandem.orchestrator import EvalBeside
    from tandem.orchestrator.policy import clone_model

    tasks = TaskConfig(functions=["gcd", "digit_sum"], functions_per_repo=1, eval_seed=81)
    config = RunConfig(
        model=TINY, tasks=tasks, env=ENV, engine=ENGINE, eval=EvalConfig(tasks=6, engines=2)
    )
    model = build_model(copy.copy(TINY), ByteTokenizer())
    as_given = clone_model(model)
    assert EvalBeside.possible(config)
    beside = EvalBeside(model, config)
    with torch.no_grad():  # "training" meanwhile
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    (tmp_path / "tokenizer.json").write_text("{not json")
    model.config.path = str(tmp_path)
    policy: dict[int, int] = {}  # the last seen of each replica (set once it has started)
    while beside.running():
        for child in multiprocessing.active_children():
            if child.name.startswith("tandem-eval-replica") and child.pid is not None:
                with contextlib.suppress(OSError):
                    policy[child.pid] = os.sched_getscheduler(child.pid)
        time.sleep(0.05)
    assert beside.result() == evaluate_policy(as_given, config)
    assert len(policy) == 2 and set(policy.values()) == {os.SCHED_IDLE}
    held_out = TaskSource(tasks, tasks.eval_seed).take(0, 6)
    with pytest.raises(ReplicaFailed, match="Tokenizer"):  # playing the changed original
        play_on_replicas(model, config, held_out, samples=1, replicas=2)
    one_engine = msgspec.structs.replace(config, eval=EvalConfig(tasks=6, engines=1))
    assert not EvalBeside.possible(one_engine)  # it would play in this process
