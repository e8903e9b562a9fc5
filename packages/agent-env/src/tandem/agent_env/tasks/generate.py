"""Generated tasks: a small Python repository with one injected bug and hidden tests.

Task ``i`` of seed ``s`` depends only on (s, i), so ``generate_tasks(s, 100)[:10]`` equals
``generate_tasks(s, 10)`` and held-out sets are simply other seeds. Every task is checked by
construction: each fail-to-pass test fails on the buggy code and passes on the reference, and
each pass-to-pass test passes on both (evaluated with a deterministic line budget).
"""

from __future__ import annotations

import ast
import random
from collections.abc import Sequence

from tandem.agent_env.errors import SandboxError
from tandem.agent_env.sandbox.inside.canon import canon
from tandem.agent_env.task import HiddenCase, HiddenTests, ReferenceEdit, Task
from tandem.agent_env.tasks import execute, mutate
from tandem.agent_env.tasks.templates import TEMPLATES, Template

MODULE_NAMES = (
    "textkit",
    "numkit",
    "seqkit",
    "listkit",
    "datakit",
    "gridkit",
    "toolbelt",
    "basics",
)
_VISIBLE_CMD = "python3 -m unittest discover -s tests -t . -q"


def _literal(value: object) -> str:
    text = repr(value)
    if ast.literal_eval(text) != value:
        raise ValueError(f"{value!r} does not round-trip as a literal")
    return text


def _call_text(fn: str, args: tuple) -> str:
    return f"{fn}({', '.join(_literal(a) for a in args)})"


def _inputs(rng: random.Random, t: Template, want: int) -> list[tuple]:
    seen: dict[str, tuple] = {}
    for _ in range(want * 6):
        args = t.inputs(rng)
        seen.setdefault(repr(args), args)
        if len(seen) >= want:
            break
    return list(seen.values())


def _outcome_text(result: tuple[str, object]) -> str:
    kind, value = result
    return f"raises {value}" if kind == "raise" else f"returns {value!r}"


def hidden_case(test_id: str, imports: str, expr: str, expected: object) -> HiddenCase:
    """A hidden test as data: the call, and its expected result's canonical text (exact
    types and values), which stays on the host."""
    return HiddenCase(test_id, imports, expr, canon(expected))


def _test_method(fn: str, i: int, args: tuple, expected: object) -> str:
    return f"    def test_{fn}_{i}(self):\n        self.assertEqual({_call_text(fn, args)}, {_literal(expected)})\n"


def generate_task(
    seed: int,
    index: int,
    kinds: Sequence[str] = mutate.BUG_KINDS,
    functions_per_repo: int = 3,
    hidden_per_function: int = 8,
    *,
    functions: Sequence[str] | None = None,
    modules: Sequence[str] | None = None,
) -> Task:
    """Task number ``index`` of ``seed`` (deterministic).

    ``functions`` narrows the template functions the bug is drawn from (and the repository's
    other functions), ``modules`` the module names; both default to all of them.
    """
    pool = _pick(TEMPLATES, functions)
    names = tuple(modules) if modules else MODULE_NAMES
    rng = random.Random(f"tandem-agent-env:{seed}:{index}")
    for attempt in range(400):
        kind = kinds[(index + attempt // 40) % len(kinds)]
        target = rng.choice(pool)
        cands = mutate.candidates(target.source, target.name, kind)
        if not cands:
            continue
        m = mutate.pick(rng, cands)
        try:
            buggy_src = mutate.apply(target.source, m)
        except SyntaxError:
            continue
        ref = execute.load(target.source, target.name)
        bug = execute.load(buggy_src, target.name)
        f2p: list[tuple[tuple, object]] = []
        p2p: list[tuple[tuple, object]] = []
        example = None
        rejected = False
        for args in _inputs(rng, target, hidden_per_function * 2):
            want = execute.call(ref, target.name, args)
            if want[0] != "ok":
                continue
            got = execute.call(bug, target.name, args)
            if got[0] == "budget":
                rejected = True
                break
            if execute.same(want, got):
                p2p.append((args, want[1]))
            else:
                f2p.append((args, want[1]))
                example = example or (args, want[1], got)
        if rejected or not f2p or example is None:
            continue
        try:
            return _assemble(
                rng,
                seed,
                index,
                kind,
                m,
                target,
                buggy_src,
                f2p,
                p2p,
                example,
                functions_per_repo,
                hidden_per_function,
                pool,
                names,
            )
        except ValueError:
            continue
    raise SandboxError(f"could not generate task {index} of seed {seed} for kinds {list(kinds)}")


def _assemble(
    rng: random.Random,
    seed: int,
    index: int,
    kind: str,
    m: mutate.Mutation,
    target: Template,
    buggy_src: str,
    f2p: list[tuple[tuple, object]],
    p2p: list[tuple[tuple, object]],
    example: tuple[tuple, object, tuple[str, object]],
    functions_per_repo: int,
    hidden_per_function: int,
    pool: Sequence[Template],
    modules: Sequence[str],
) -> Task:
    module = rng.choice(modules)
    others = rng.sample([t for t in pool if t is not target], functions_per_repo - 1)
    order = [target, *others]
    rng.shuffle(order)
    header = f'"""{module}: small utility functions."""\n\n\n'
    fixed_mod = header + "\n\n".join(t.source for t in order)
    buggy_mod = header + "\n\n".join(buggy_src if t is target else t.source for t in order)
    old, new = mutate.fix_edit(fixed_mod, buggy_mod)

    hidden: list[HiddenCase] = []

    def add_case(test_id: str, fn: str, args: tuple, expected: object) -> None:
        hidden.append(
            hidden_case(test_id, f"from {module} import {fn}", _call_text(fn, args), expected)
        )

    f2p_ids: list[str] = []
    p2p_ids: list[str] = []
    case = 0
    for args, expected in f2p[:hidden_per_function]:
        f2p_ids.append(f"tests.test_hidden.HiddenTests.test_{target.name}_{case}")
        add_case(f2p_ids[-1], target.name, args, expected)
        case += 1
    for args, expected in p2p[: max(2, hidden_per_function - len(f2p))]:
        p2p_ids.append(f"tests.test_hidden.HiddenTests.test_{target.name}_{case}")
        add_case(p2p_ids[-1], target.name, args, expected)
        case += 1
    visible = [
        "import unittest\n",
        f"from {module} import {', '.join(sorted(t.name for t in order))}\n\n",
    ]
    visible.append(f"\nclass Test{module.capitalize()}(unittest.TestCase):\n")
    vis_ids: list[str] = []
    for t in others:
        ref = execute.load(t.source, t.name)
        for i, args in enumerate(_inputs(rng, t, 3)):
            res = execute.call(ref, t.name, args)
            if res[0] != "ok":
                continue
            method = _test_method(t.name, i, args, res[1])
            if i < 2:
                visible.append(method)
                vis_ids.append(f"tests.test_{module}.Test{module.capitalize()}.test_{t.name}_{i}")
                add_case(vis_ids[-1], t.name, args, res[1])
            else:
                p2p_ids.append(f"tests.test_hidden.HiddenTests.test_{t.name}_{i}")
                add_case(p2p_ids[-1], t.name, args, res[1])
    # Tests of the buggy function that pass before the fix: the ones the hidden set left
    # over, else one it holds too (a repository alone with its buggy function still has one).
    shown = p2p[max(2, hidden_per_function - len(f2p)) :][:2] or p2p[-1:]
    for args, expected in shown:
        visible.append(_test_method(target.name, case, args, expected))
        vis_ids.append(f"tests.test_{module}.Test{module.capitalize()}.test_{target.name}_{case}")
        add_case(vis_ids[-1], target.name, args, expected)
        case += 1
    if not vis_ids:  # every input shows the bug: a test class with no test, still valid Python
        visible.append("    pass\n")
    visible_path = f"tests/test_{module}.py"
    args, expected, got = example
    instruction = (
        f"There is a bug in `{target.name}` in `{module}.py`: `{_call_text(target.name, args)}` "
        f"{_outcome_text(got)}, but it should return {expected!r}.\n\n"
        f"Fix `{module}.py` so that `{target.name}` does what its docstring says for every input, "
        "not only this one. Run the visible tests with run_tests, then submit."
    )
    return Task(
        id=f"gen-{seed}-{index}",
        instruction=instruction,
        files={f"{module}.py": buggy_mod, "tests/__init__.py": "", visible_path: "".join(visible)},
        hidden_tests=HiddenTests(
            fail_to_pass=tuple(f2p_ids),
            pass_to_pass=tuple(p2p_ids + vis_ids),
            reset_paths=(visible_path, "tests/__init__.py"),
            cases=tuple(hidden),
        ),
        visible_test_command=_VISIBLE_CMD,
        reference_edits=(ReferenceEdit(f"{module}.py", old, new),),
        metadata={
            "source": "generated",
            "bug_kind": kind,
            "function": target.name,
            "mutation": m.description,
            "seed": str(seed),
            "index": str(index),
        },
    )


def _pick(templates: Sequence[Template], names: Sequence[str] | None) -> list[Template]:
    """The named templates in their own order (so the order of ``names`` changes nothing)."""
    if not names:
        return list(templates)
    by_name = {t.name: t for t in templates}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SandboxError(f"functions: unknown {unknown}; choose from {sorted(by_name)}")
    wanted = set(names)
    return [t for t in templates if t.name in wanted]


def check_task_family(
    kinds: Sequence[str],
    functions_per_repo: int,
    functions: Sequence[str] | None = None,
    modules: Sequence[str] | None = None,
) -> None:
    """Raise `SandboxError`, naming the argument, when these settings cannot generate tasks.

    Callers that take the settings from a config check them here at start (the message begins
    with the argument's name) instead of on the first task.
    """
    bad = [k for k in kinds if k not in mutate.BUG_KINDS]
    if bad or not kinds:
        raise SandboxError(f"kinds: unknown bug kinds {bad}; choose from {mutate.BUG_KINDS}")
    pool = _pick(TEMPLATES, functions)
    if not 1 <= functions_per_repo <= len(pool):
        raise SandboxError(f"functions_per_repo: must be in 1..{len(pool)}")
    bad_modules = [m for m in modules or () if not m.isidentifier()]
    if bad_modules:
        raise SandboxError(f"modules: {bad_modules} are not Python identifiers")


def generate_tasks(
    seed: int,
    n: int,
    *,
    start: int = 0,
    kinds: Sequence[str] = mutate.BUG_KINDS,
    functions_per_repo: int = 3,
    hidden_per_function: int = 8,
    functions: Sequence[str] | None = None,
    modules: Sequence[str] | None = None,
) -> list[Task]:
    """``n`` generated tasks, numbers ``start .. start + n - 1`` of ``seed``.

    Bug kinds rotate with the index (so any 7 consecutive tasks cover all kinds). Use
    different seeds for training and held-out sets. ``functions`` and ``modules`` narrow the
    task family (the template functions and module names drawn from; default: all), e.g. for
    a curriculum or a small model's demo.
    """
    check_task_family(kinds, functions_per_repo, functions, modules)
    return [
        generate_task(
            seed,
            i,
            kinds,
            functions_per_repo,
            hidden_per_function,
            functions=functions,
            modules=modules,
        )
        for i in range(start, start + n)
    ]
