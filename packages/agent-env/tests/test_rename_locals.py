"""Renamed locals: every template keeps its behaviour, tasks stay valid and stop sharing fix
texts, and the renaming leaves attributes, call keywords and the function's name alone."""

from __future__ import annotations

import ast
import builtins
import keyword
import random

import pytest

from tandem.agent_env import generate_tasks
from tandem.agent_env.tasks import execute
from tandem.agent_env.tasks.rename import NAME_POOL, rename_mapping, rename_source, renamed
from tandem.agent_env.tasks.templates import TEMPLATES

DEMO = {"functions": ["gcd", "digit_sum", "is_palindrome", "chunked"], "modules": ["toolbelt"]}


def test_the_pool_holds_no_builtin_or_keyword_and_no_repeat() -> None:
    assert len(set(NAME_POOL)) == len(NAME_POOL)
    assert not [n for n in NAME_POOL if keyword.iskeyword(n) or hasattr(builtins, n)]


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda t: t.name)
def test_a_renamed_template_computes_what_the_original_does(template) -> None:
    rng = random.Random(template.name)
    original = execute.load(template.source, template.name)
    for _ in range(6):
        other = renamed(template, rng)
        fn = next(n for n in ast.parse(other.source).body if isinstance(n, ast.FunctionDef))
        assert fn.name == template.name
        twin = execute.load(other.source, other.name)
        for _ in range(25):
            args = template.inputs(rng)
            want = execute.call(original, template.name, args)
            assert execute.same(want, execute.call(twin, template.name, args)), other.source


def test_attributes_call_keywords_and_other_names_keep_theirs() -> None:
    source = (
        "def f(text, size=2):\n"
        '    """Cut text into size pieces."""\n'
        "    out = sorted(text.split(), key=len)\n"
        "    out.append(dict(size=size))\n"
        "    return out\n"
    )
    mapping = {"text": "xs", "size": "n", "out": "acc"}
    got = rename_source(source, mapping, ["text", "size"])
    assert got == (
        "def f(xs, n=2):\n"
        '    """Cut xs into n pieces."""\n'
        "    acc = sorted(xs.split(), key=len)\n"
        "    acc.append(dict(size=n))\n"
        "    return acc\n"
    )


def test_the_mapping_never_takes_a_name_the_source_uses_otherwise() -> None:
    source = "def f(a):\n    n = len(a)\n    return n + total\n"
    for seed in range(50):
        mapping = rename_mapping(ast.parse(source), "f", random.Random(seed))
        assert set(mapping) == {"a", "n"}
        assert "total" not in mapping.values() and len(set(mapping.values())) == 2


def test_renamed_tasks_are_valid_and_their_fix_texts_rarely_repeat() -> None:
    kinds = ["wrong_operator", "off_by_one"]
    plain = generate_tasks(7, 48, kinds=kinds, **DEMO)
    tasks = generate_tasks(7, 48, kinds=kinds, rename_locals=True, **DEMO)
    for task in tasks:
        path = next(p for p in task.files if not p.startswith("tests/"))
        (edit,) = task.reference_edits
        buggy = task.files[path]
        assert buggy.count(edit.old) == 1, task.id
        fixed = buggy.replace(edit.old, edit.new)
        ref = execute.load(fixed, task.metadata["function"])
        twin = next(t for t in TEMPLATES if t.name == task.metadata["function"])
        original = execute.load(twin.source, twin.name)
        rng = random.Random(task.id)
        for _ in range(20):
            args = twin.inputs(rng)
            want = execute.call(original, twin.name, args)
            assert execute.same(want, execute.call(ref, twin.name, args)), (task.id, fixed)
    # the same categories, far more distinct fix texts than without the renaming
    assert {t.metadata["function"] for t in tasks} == {t.metadata["function"] for t in plain}
    fixes = lambda ts: len({t.reference_edits[0].old for t in ts})  # noqa: E731
    assert fixes(plain) <= 16 and fixes(tasks) >= 36, (fixes(plain), fixes(tasks))
    assert generate_tasks(7, 5, kinds=kinds, rename_locals=True, **DEMO) == tasks[:5]
