"""Held-out evaluation end to end (engine, sandbox, grading) and its per-category table."""

from __future__ import annotations

from collections import Counter
from typing import Any

import msgspec
import pytest
from rl_helpers import ENGINE, ENV, TINY

from tandem.app.demo_report import CATEGORY_COLUMNS, category_rows
from tandem.orchestrator import RunConfig, build_model, evaluate_policy, stages
from tandem.orchestrator.artifacts.report import markdown_table
from tandem.orchestrator.config import EvalConfig, TaskConfig
from tandem.orchestrator.eval.passk import CategoryScore, EvalResult
from tandem.orchestrator.inference.tokenizer import ByteTokenizer
from tandem.orchestrator.rollout.tasks import TaskSource
from tandem.orchestrator.wire import Sample


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


def _result(scores: dict[str, tuple[int, float]]) -> EvalResult:
    return EvalResult(
        tasks=sum(n for n, _ in scores.values()),
        samples_per_task=4,
        pass_at={1: 0.0},
        mean_reward=0.0,
        format_error_rate=0.0,
        mean_turns=2.0,
        infra_faults=0,
        by_category={c: CategoryScore(n, p) for c, (n, p) in scores.items()},
    )


def test_demo_category_table_gives_the_change_per_category() -> None:
    before = _result({"gcd/off_by_one": (3, 0.25), "gcd/swapped_arguments": (2, 1.0)})
    after = _result({"gcd/off_by_one": (3, 0.75), "gcd/swapped_arguments": (2, 0.5)})
    rows = category_rows(before, after)
    assert rows == [
        ("gcd/off_by_one", "3", "0.25", "0.75", "+50.0"),
        ("gcd/swapped_arguments", "2", "1.00", "0.50", "-50.0"),
    ]
    lines = markdown_table(rows, CATEGORY_COLUMNS).splitlines()
    assert len(lines) == 4
    assert lines[0].split("|")[1:-1] == [
        f" {c:<21} " if i == 0 else f" {c} " for i, c in enumerate(CATEGORY_COLUMNS)
    ]
    assert lines[1].count("|") == len(CATEGORY_COLUMNS) + 1
    assert lines[2] == "| gcd/off_by_one        | 3 | 0.25 | 0.75 | +50.0 |"


def test_engine_replicas_play_every_episode_as_one_engine_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two engines (threads, one torch thread each) share the tasks; every episode still
    samples the same tokens with the same log-probs, so the evaluation is the same."""
    played: list[list[list[Sample]]] = []
    real = stages.evaluate

    async def recording(*args: Any, **kwargs: Any) -> Any:
        result, per_task = await real(*args, **kwargs)
        played.append(per_task)
        return result, per_task

    monkeypatch.setattr(stages, "evaluate", recording)
    tasks = TaskConfig(functions=["gcd", "digit_sum"], functions_per_repo=1, eval_seed=78)
    model = build_model(TINY, ByteTokenizer())
    engine = msgspec.structs.replace(ENGINE, max_slots=3)  # fewer slots than episodes
    results = [
        evaluate_policy(
            model,
            RunConfig(
                model=TINY,
                tasks=tasks,
                env=ENV,
                engine=engine,
                eval=EvalConfig(tasks=5, samples=2, engines=replicas),
            ),
        )
        for replicas in (1, 2)
    ]
    one, two = (
        [[(s.task_id, s.tokens, s.logprobs, s.turns) for s in samples] for samples in per_task]
        for per_task in played
    )
    assert len(one) == 5 and all(len(samples) == 2 for samples in one)
    assert one == two
    assert len({tuple(tokens) for task in one for _, tokens, _, _ in task}) > 1
    assert results[0] == results[1]
