"""Multi-bug generated tasks: several modules, several bugs, no file named; checked against
the templates and the host's own evaluation, and played end to end through the sandbox."""

from __future__ import annotations

import ast
import asyncio
import difflib
import re

import msgspec
import pytest

from tandem.agent_env import (
    EnvConfig,
    OraclePolicy,
    Task,
    generate_multibug_tasks,
    generate_tasks,
    oracle_script,
    run_episodes,
    submit_at_once,
)
from tandem.agent_env.sandbox.inside.canon import canon
from tandem.agent_env.tasks import execute
from tandem.agent_env.tasks.generate import MODULE_NAMES
from tandem.agent_env.tasks.mutate import BUG_KINDS
from tandem.agent_env.tasks.templates import TEMPLATES

SOURCE = {t.name: t.source for t in TEMPLATES}
SMALL = {"modules": 4, "buggy": 3, "functions_per_module": 3}  # a non-default family


def _modules(task: Task) -> dict[str, str]:
    return {p: text for p, text in task.files.items() if not p.startswith("tests/")}


def _defined(text: str) -> list[str]:
    return [n.name for n in ast.parse(text).body if isinstance(n, ast.FunctionDef)]


def _function_trees(text: str) -> dict[str, str]:
    return {n.name: ast.dump(n) for n in ast.parse(text).body if isinstance(n, ast.FunctionDef)}


def _fixed(task: Task, edits: int | None = None) -> dict[str, str]:
    """The modules after the first ``edits`` reference edits (all by default), applied as the
    `edit` tool does: the old text must occur exactly once."""
    files = _modules(task)
    for e in task.reference_edits[:edits]:
        assert files[e.path].count(e.old) == 1, e
        files[e.path] = files[e.path].replace(e.old, e.new)
    return files


def _host_score(task: Task, files: dict[str, str]) -> float:
    """The partial-credit reward computed here, independently of the sandbox: the share of
    hidden cases whose call on ``files`` gives the expected canonical value."""
    passed = 0
    for case in task.hidden_tests.cases:
        module, fn = re.fullmatch(r"from (\w+) import (\w+)", case.imports).groups()
        args = ast.literal_eval(f"({case.expr[len(fn) + 1 : -1]},)")
        kind, value = execute.call(execute.load(files[f"{module}.py"], module), fn, args)
        passed += kind == "ok" and canon(value) == case.expected
    return passed / len(task.hidden_tests.cases)


def test_deterministic_prefix_stable_seed_separated_and_ids_unique() -> None:
    a = generate_multibug_tasks(3, 6)
    assert msgspec.json.encode(a) == msgspec.json.encode(generate_multibug_tasks(3, 6))
    assert msgspec.json.encode(generate_multibug_tasks(3, 2, start=4)) == msgspec.json.encode(a[4:])
    other = generate_multibug_tasks(4, 6)
    assert {t.instruction for t in a}.isdisjoint({t.instruction for t in other})
    assert {msgspec.json.encode(t.files) for t in a}.isdisjoint(
        {msgspec.json.encode(t.files) for t in other}
    )
    tasks = [*a, *other, *generate_multibug_tasks(3, 6, **SMALL)]
    assert len({t.instruction for t in tasks}) == len(tasks)
    ids = [t.id for t in [*a, *other]]
    assert len(set(ids)) == len(ids) and all(i.startswith("multibug-") for i in ids)
    assert set(ids).isdisjoint(t.id for t in generate_tasks(3, 6) + generate_tasks(4, 6))
    for t in a:
        assert msgspec.json.decode(msgspec.json.encode(t), type=Task) == t


@pytest.mark.parametrize("settings", [{}, SMALL], ids=["default", "small"])
def test_exactly_buggy_modules_differ_by_one_bug_and_the_edits_restore_the_templates(
    settings: dict,
) -> None:
    modules, buggy = settings.get("modules", 6), settings.get("buggy", 4)
    per_module = settings.get("functions_per_module", 2)
    kinds_seen: set[str] = set()
    for task in generate_multibug_tasks(5, 8, **settings):
        files, fixed = _modules(task), _fixed(task)
        names = [p.removesuffix(".py") for p in files]
        assert len(names) == modules and set(names) <= set(MODULE_NAMES)
        assert {p for p in task.files if p.startswith("tests/test_")} == {
            f"tests/test_{n}.py" for n in names
        }
        functions = [fn for text in fixed.values() for fn in _defined(text)]
        assert len(functions) == len(set(functions)) == modules * per_module
        for path, text in fixed.items():  # the correct source, function for function
            header = f'"""{path.removesuffix(".py")}: small utility functions."""\n\n\n'
            assert text == header + "\n\n".join(SOURCE[fn] for fn in _defined(text))
        differing = {p for p in files if files[p] != fixed[p]}
        assert len(differing) == buggy == len(task.reference_edits) == int(task.metadata["buggy"])
        assert [e.path for e in task.reference_edits] == [p for p in files if p in differing]
        bug_functions = [task.metadata[f"bug{j}_function"] for j in range(buggy)]
        assert task.metadata["functions"].split(",") == bug_functions
        for j, path in enumerate(e.path for e in task.reference_edits):
            hunks = [
                op
                for op in difflib.SequenceMatcher(
                    None, fixed[path].split("\n"), files[path].split("\n")
                ).get_opcodes()
                if op[0] != "equal"
            ]
            assert len(hunks) == 1, (task.id, path, hunks)  # one contiguous change
            assert bug_functions[j] in _defined(fixed[path])
            # the bug is in the named function, and only there
            ref, bad = _function_trees(fixed[path]), _function_trees(files[path])
            assert [fn for fn in ref if ref[fn] != bad[fn]] == [bug_functions[j]], task.id
            assert task.metadata[f"bug{j}_kind"] in BUG_KINDS
            kinds_seen.add(task.metadata[f"bug{j}_kind"])
        assert all(isinstance(v, str) for v in task.metadata.values())
        assert task.metadata["source"] == "multibug"
        # hidden tests cover every function; only the fix passes them all
        h = task.hidden_tests
        case_ids = [c.id for c in h.cases]
        assert sorted(case_ids) == sorted([*h.fail_to_pass, *h.pass_to_pass])
        tested = {c.imports.rsplit(" ", 1)[-1] for c in h.cases}
        assert tested == set(functions)
        assert {c.expr.split("(")[0] for c in h.cases if c.id in h.fail_to_pass} == set(
            bug_functions
        )
        assert _host_score(task, fixed) == 1.0
        assert 0.0 < _host_score(task, files) < 1.0
    assert len(kinds_seen) >= 4  # the kinds rotate


def test_instruction_states_every_failing_call_and_no_module() -> None:
    for task in generate_multibug_tasks(8, 6):
        text, files, fixed = task.instruction, _modules(task), _fixed(task)
        assert "several modules" in text
        assert ".py" not in text and not any(n in text for n in MODULE_NAMES)
        bullets = re.findall(
            r"^- `(\w+)`: `(.+?)` (returns|raises) (.+), but it should return (.+)\.$",
            text,
            flags=re.M,
        )
        assert [b[0] for b in bullets] == task.metadata["functions"].split(",")
        for fn, call, verb, got, want in bullets:
            path = next(p for p, src in fixed.items() if fn in _defined(src))
            args = ast.literal_eval(f"({call[len(fn) + 1 : -1]},)")
            good = execute.call(execute.load(fixed[path], "good"), fn, args)
            bad = execute.call(execute.load(files[path], "bad"), fn, args)
            assert good == ("ok", ast.literal_eval(want)), (task.id, call)
            if verb == "raises":
                assert bad == ("raise", got), (task.id, call)
            else:
                assert bad[0] == "ok" and repr(bad[1]) == got, (task.id, call)


def test_oracle_script_is_long_and_one_bug_scripts_are_unchanged() -> None:
    (default,) = generate_multibug_tasks(0, 1)
    assert len(oracle_script(default)) == 2 * 4 + 4 == 12
    (three,) = generate_multibug_tasks(0, 1, modules=3, buggy=3)
    names = [c.name for c in oracle_script(three)]
    assert len(names) >= 10
    assert names == ["list_dir", "run_tests", *["read_file"] * 3, *["edit"] * 3, "run_tests",
                     "submit"]  # fmt: skip
    (one,) = generate_tasks(0, 1)
    assert [c.name for c in oracle_script(one)] == [
        "list_dir", "read_file", "edit", "run_tests", "submit"
    ]  # fmt: skip


def _play(policy, tasks: list[Task], config: EnvConfig) -> list[float | None]:
    trajs = asyncio.run(run_episodes(policy, tasks, concurrency=4, config=config))
    assert not any(t.infra_fault for t in trajs), [t.grade_detail for t in trajs]
    return [t.reward for t in trajs]


def test_oracle_resolves_and_partial_credit_counts_each_fixed_bug(config: EnvConfig) -> None:
    tasks = [*generate_multibug_tasks(21, 1), *generate_multibug_tasks(22, 1, **SMALL)]
    partial = msgspec.structs.replace(config, partial_credit=True)
    assert _play(OraclePolicy(tasks), tasks, config) == [1.0, 1.0]
    assert _play(submit_at_once, tasks, config) == [0.0, 0.0]
    # unfixed, and with only the first bug fixed: strictly between 0 and 1, rising with
    # each fix, and what the sandbox grades equals what the host computes
    unfixed = _play(submit_at_once, tasks, partial)
    one_fix = [msgspec.structs.replace(t, reference_edits=t.reference_edits[:1]) for t in tasks]
    first = _play(OraclePolicy(one_fix), one_fix, partial)
    for task, r0, r1 in zip(tasks, unfixed, first, strict=True):
        assert r0 == pytest.approx(_host_score(task, _modules(task)))
        assert r1 == pytest.approx(_host_score(task, _fixed(task, 1)))
        assert 0.0 < r0 < r1 < 1.0


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"buggy": 2}, "buggy"),
        ({"modules": 4, "buggy": 5}, "buggy"),
        ({"modules": 9, "buggy": 4}, "modules"),
        ({"modules": 6, "functions_per_module": 4}, "modules"),
        ({"functions_per_module": 0}, "functions_per_module"),
        ({"kinds": ("off_by_one", "no_such_kind")}, "kinds"),
        ({"kinds": ()}, "kinds"),
        ({"kinds": "off_by_one"}, "kinds"),
        ({"hidden_per_function": 0}, "hidden_per_function"),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_argument(kwargs: dict, argument: str) -> None:
    with pytest.raises(ValueError, match=rf"^{argument}: "):
        generate_multibug_tasks(0, 1, **kwargs)
