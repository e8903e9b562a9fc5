"""Generated tasks: deterministic, varied, and verified end to end through the sandbox."""

from __future__ import annotations

import ast
import asyncio
from collections import Counter

import msgspec
import pytest

from tandem.agent_env import (
    EnvConfig,
    OraclePolicy,
    SandboxError,
    Task,
    generate_tasks,
    run_episodes,
    submit_at_once,
)
from tandem.agent_env.sandbox.inside.canon import canon
from tandem.agent_env.tasks import execute
from tandem.agent_env.tasks.generate import MODULE_NAMES
from tandem.agent_env.tasks.mutate import BUG_KINDS
from tandem.agent_env.tasks.templates import TEMPLATES


def test_seed_to_task_mapping_is_deterministic_and_prefix_stable() -> None:
    a = generate_tasks(3, 10)
    b = generate_tasks(3, 10)
    assert [msgspec.json.encode(t) for t in a] == [msgspec.json.encode(t) for t in b]
    assert msgspec.json.encode(generate_tasks(3, 4, start=6)) == msgspec.json.encode(a[6:])
    other = generate_tasks(4, 10)
    assert {t.instruction for t in a}.isdisjoint({t.instruction for t in other})


def test_every_bug_kind_is_generated_and_tasks_roundtrip_as_json() -> None:
    tasks = generate_tasks(0, 2 * len(BUG_KINDS))
    assert Counter(t.metadata["bug_kind"] for t in tasks) == {k: 2 for k in BUG_KINDS}
    for t in tasks:
        assert msgspec.json.decode(msgspec.json.encode(t), type=Task) == t
        assert t.hidden_tests.fail_to_pass, t.id
        for path, text in {**t.files, **t.hidden_tests.files}.items():
            if path.endswith(".py"):
                ast.parse(text)


def _module(task: Task) -> tuple[str, str]:
    path = next(p for p in task.files if not p.startswith("tests/"))
    return path, task.files[path]


def test_reference_fix_is_an_exact_unique_edit_that_restores_behaviour() -> None:
    """Checked independently of the generator's own bookkeeping: apply the edit as the
    `edit` tool would, then compare the function with the buggy one on the hidden inputs."""
    for task in generate_tasks(5, 14):
        path, buggy = _module(task)
        (edit,) = task.reference_edits
        assert edit.path == path and buggy.count(edit.old) == 1
        fixed = buggy.replace(edit.old, edit.new)
        fn = task.metadata["function"]
        cases = [c for c in task.hidden_tests.cases if c.expr.startswith(f"{fn}(")]
        good, bad = execute.load(fixed, "fixed"), execute.load(buggy, "buggy")
        differing = 0
        for case in cases:
            args = ast.literal_eval(f"({case.expr[len(fn) + 1 : -1]},)")
            kind, value = execute.call(good, fn, args)
            assert kind == "ok" and canon(value) == case.expected, case
            differing += not execute.same(execute.call(bad, fn, args), ("ok", value))
        assert differing == len(task.hidden_tests.fail_to_pass)


def _rewards(policy, tasks: list[Task], config: EnvConfig) -> list[float | None]:
    trajs = asyncio.run(run_episodes(policy, tasks, concurrency=16, config=config))
    assert [t.task_id for t in trajs] == [t.id for t in tasks]
    assert not any(t.infra_fault for t in trajs), [t.grade_detail for t in trajs if t.infra_fault]
    return [t.reward for t in trajs]


def test_oracle_scores_one_and_submit_at_once_scores_zero(config: EnvConfig) -> None:
    tasks = generate_tasks(7, 3 * len(BUG_KINDS))
    assert _rewards(OraclePolicy(tasks), tasks, config) == [1.0] * len(tasks)
    assert _rewards(submit_at_once, tasks, config) == [0.0] * len(tasks)


@pytest.mark.slow
def test_oracle_and_submit_on_many_generated_tasks(config: EnvConfig) -> None:
    tasks = generate_tasks(1234, 20 * len(BUG_KINDS))
    assert _rewards(OraclePolicy(tasks), tasks, config) == [1.0] * len(tasks)
    assert _rewards(submit_at_once, tasks, config) == [0.0] * len(tasks)


def test_narrow_family_files_parse_and_the_oracle_tells_tasks_with_one_instruction_apart(
    config: EnvConfig,
) -> None:
    """A one-function repository of a narrow family: its visible tests still form a valid
    module, and tasks that share an instruction (same function, kind and failing example,
    another mutation) each get their own fix from the oracle under `run_episodes`."""
    tasks = generate_tasks(
        1,
        120,
        kinds=("wrong_operator", "off_by_one", "swapped_arguments"),
        functions_per_repo=1,
        hidden_per_function=6,
        functions=["gcd", "digit_sum", "fizzbuzz", "is_palindrome"],
        modules=["toolbelt"],
    )
    for t in tasks:
        for path, text in t.files.items():
            ast.parse(text, filename=f"{t.id}:{path}")  # raises on an unparsable file
    shared = [i for i, n in Counter(t.instruction for t in tasks).items() if n > 1]
    assert shared, "no two tasks share an instruction: the case below is not exercised"
    ambiguous = [t for t in tasks if t.instruction == shared[0]]
    assert len({t.reference_edits for t in ambiguous}) > 1  # different fixes behind one text
    assert _rewards(OraclePolicy(tasks), tasks, config) == [1.0] * len(tasks)
    messages = [{"role": "user", "content": shared[0]}]
    with pytest.raises(SandboxError, match="share this instruction"):
        asyncio.run(OraclePolicy(tasks)(messages))


def test_task_family_can_be_narrowed_to_functions_and_modules() -> None:
    funcs = ["gcd", "fizzbuzz", "digit_sum"]
    tasks = generate_tasks(6, 24, functions=funcs, modules=["toolbelt"], functions_per_repo=2)
    for t in tasks:
        assert t.metadata["function"] in funcs
        path, text = _module(t)
        assert path == "toolbelt.py"
        defined = {n.name for n in ast.parse(text).body if isinstance(n, ast.FunctionDef)}
        assert len(defined) == 2 and defined <= set(funcs)
    assert {t.metadata["function"] for t in tasks} == set(funcs)
    # Naming every function (in any order) and every module gives the default family, task
    # for task: the pool keeps the templates' own order, so the seeded draws are the same.
    everything = generate_tasks(
        3,
        4,
        functions=[t.name for t in reversed(TEMPLATES)],
        modules=list(MODULE_NAMES),
    )
    assert msgspec.json.encode(everything) == msgspec.json.encode(generate_tasks(3, 4))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"functions": ["gcd", "no_such_fn"]}, "no_such_fn"),
        ({"functions": ["gcd"], "functions_per_repo": 2}, "functions_per_repo"),
        ({"modules": ["not-a-module"]}, "not-a-module"),
    ],
)
def test_narrowed_family_rejects_bad_names(kwargs: dict, message: str) -> None:
    with pytest.raises(SandboxError, match=message):
        generate_tasks(0, 1, **kwargs)
