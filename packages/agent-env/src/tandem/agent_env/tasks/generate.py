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
from dataclasses import dataclass

from tandem.agent_env.errors import SandboxError
from tandem.agent_env.sandbox.inside.canon import canon
from tandem.agent_env.task import HiddenCase, HiddenTests, ReferenceEdit, Task
from tandem.agent_env.tasks import execute, mutate
from tandem.agent_env.tasks.rename import renamed
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
VISIBLE_CMD = "python3 -m unittest discover -s tests -t . -q"


def _literal(value: object) -> str:
    text = repr(value)
    if ast.literal_eval(text) != value:
        raise ValueError(f"{value!r} does not round-trip as a literal")
    return text


def call_text(fn: str, args: tuple) -> str:
    """The call ``fn(*args)`` as source text (the form instructions and hidden cases use)."""
    return f"{fn}({', '.join(_literal(a) for a in args)})"


def _inputs(rng: random.Random, t: Template, want: int) -> list[tuple]:
    seen: dict[str, tuple] = {}
    for _ in range(want * 6):
        args = t.inputs(rng)
        seen.setdefault(repr(args), args)
        if len(seen) >= want:
            break
    return list(seen.values())


def outcome_text(result: tuple[str, object]) -> str:
    """What a call did, as an instruction says it (``returns 3``, ``raises ValueError: ..``)."""
    kind, value = result
    return f"raises {value}" if kind == "raise" else f"returns {value!r}"


def hidden_case(test_id: str, imports: str, expr: str, expected: object) -> HiddenCase:
    """A hidden test as data: the call, and its expected result's canonical text (exact
    types and values), which stays on the host."""
    return HiddenCase(test_id, imports, expr, canon(expected))


def _test_method(fn: str, i: int, args: tuple, expected: object) -> str:
    return f"    def test_{fn}_{i}(self):\n        self.assertEqual({call_text(fn, args)}, {_literal(expected)})\n"


@dataclass(frozen=True)
class Bug:
    """One injected bug, checked: ``f2p`` are (args, expected) the mutant gets wrong, ``p2p``
    the ones it still gets right, and ``example`` (args, expected, what the mutant does) is
    the failing call an instruction shows."""

    kind: str
    mutation: mutate.Mutation
    target: Template
    buggy_src: str
    f2p: list[tuple[tuple, object]]
    p2p: list[tuple[tuple, object]]
    example: tuple[tuple, object, tuple[str, object]]


def inject_bug(
    rng: random.Random, target: Template, kind: str, hidden_per_function: int
) -> Bug | None:
    """A seeded bug of ``kind`` in ``target``, or None when none that a test can see was drawn.

    A mutant is kept only if some valid input shows the bug and none exceeds the line budget
    (a probable infinite loop would make grading slow rather than wrong).
    """
    cands = mutate.candidates(target.source, target.name, kind)
    if not cands:
        return None
    m = mutate.pick(rng, cands)
    try:
        buggy_src = mutate.apply(target.source, m)
    except SyntaxError:
        return None
    ref = execute.load(target.source, target.name)
    bug = execute.load(buggy_src, target.name)
    f2p: list[tuple[tuple, object]] = []
    p2p: list[tuple[tuple, object]] = []
    example = None
    for args in _inputs(rng, target, hidden_per_function * 2):
        want = execute.call(ref, target.name, args)
        if want[0] != "ok":
            continue
        got = execute.call(bug, target.name, args)
        if got[0] == "budget":
            return None
        if execute.same(want, got):
            p2p.append((args, want[1]))
        else:
            f2p.append((args, want[1]))
            example = example or (args, want[1], got)
    if not f2p or example is None:
        return None
    return Bug(kind, m, target, buggy_src, f2p, p2p, example)


class ModuleTests:
    """The tests of one generated module, drawn in a fixed order: its visible unittest file,
    and hidden cases for each of its functions (the visible tests are mirrored as hidden
    cases too, so editing the test file cannot change the verdict)."""

    def __init__(self, module: str, functions: Sequence[str]) -> None:
        self.module = module
        self.cls = f"Test{module.capitalize()}"
        self.path = f"tests/test_{module}.py"
        self.cases: list[HiddenCase] = []
        self.f2p: list[str] = []
        self.p2p: list[str] = []
        self.vis: list[str] = []
        self._visible = [
            "import unittest\n",
            f"from {module} import {', '.join(sorted(functions))}\n\n",
            f"\nclass {self.cls}(unittest.TestCase):\n",
        ]

    def _case(self, test_id: str, fn: str, args: tuple, expected: object) -> None:
        imports = f"from {self.module} import {fn}"
        self.cases.append(hidden_case(test_id, imports, call_text(fn, args), expected))

    def _hidden(self, ids: list[str], fn: str, i: int, args: tuple, expected: object) -> None:
        ids.append(f"tests.test_hidden.HiddenTests.test_{fn}_{i}")
        self._case(ids[-1], fn, args, expected)

    def _shown(self, fn: str, i: int, args: tuple, expected: object) -> None:
        self._visible.append(_test_method(fn, i, args, expected))
        self.vis.append(f"tests.test_{self.module}.{self.cls}.test_{fn}_{i}")
        self._case(self.vis[-1], fn, args, expected)

    def bug_hidden(self, bug: Bug, hidden_per_function: int) -> int:
        """Hidden tests of the buggy function: up to ``hidden_per_function`` that show the bug,
        topped up with ones that pass anyway; returns the next case number."""
        case = 0
        name = bug.target.name
        for args, expected in bug.f2p[:hidden_per_function]:
            self._hidden(self.f2p, name, case, args, expected)
            case += 1
        for args, expected in bug.p2p[: max(2, hidden_per_function - len(bug.f2p))]:
            self._hidden(self.p2p, name, case, args, expected)
            case += 1
        return case

    def correct_function(self, rng: random.Random, t: Template) -> None:
        """Two visible tests and one hidden test of a function without a bug."""
        ref = execute.load(t.source, t.name)
        for i, args in enumerate(_inputs(rng, t, 3)):
            res = execute.call(ref, t.name, args)
            if res[0] != "ok":
                continue
            if i < 2:
                self._shown(t.name, i, args, res[1])
            else:
                self._hidden(self.p2p, t.name, i, args, res[1])

    def bug_shown(self, bug: Bug, hidden_per_function: int, case: int) -> None:
        """Visible tests of the buggy function that pass before the fix: the ones the hidden
        set left over, else one it holds too (a module alone with its buggy function still
        has one)."""
        shown = bug.p2p[max(2, hidden_per_function - len(bug.f2p)) :][:2] or bug.p2p[-1:]
        for args, expected in shown:
            self._shown(bug.target.name, case, args, expected)
            case += 1

    def text(self) -> str:
        """The visible test file (a class with no test is still valid Python)."""
        return "".join(self._visible) + ("" if self.vis else "    pass\n")


def module_source(module: str, functions: Sequence[str]) -> str:
    """A generated module: a docstring, then the functions' sources."""
    return f'"""{module}: small utility functions."""\n\n\n' + "\n\n".join(functions)


def generate_task(
    seed: int,
    index: int,
    kinds: Sequence[str] = mutate.BUG_KINDS,
    functions_per_repo: int = 3,
    hidden_per_function: int = 8,
    *,
    functions: Sequence[str] | None = None,
    modules: Sequence[str] | None = None,
    rename_locals: bool = False,
) -> Task:
    """Task number ``index`` of ``seed`` (deterministic).

    ``functions`` narrows the template functions the bug is drawn from (and the repository's
    other functions), ``modules`` the module names; both default to all of them.
    ``rename_locals`` gives every function of the repository parameters and locals of its
    own, drawn per task (`rename.renamed`), so that no fix text recurs between tasks.
    """
    pool = _pick(TEMPLATES, functions)
    names = tuple(modules) if modules else MODULE_NAMES
    rng = random.Random(f"tandem-agent-env:{seed}:{index}")
    for attempt in range(400):
        kind = kinds[(index + attempt // 40) % len(kinds)]
        target = rng.choice(pool)
        if rename_locals:
            target = renamed(target, rng)
        bug = inject_bug(rng, target, kind, hidden_per_function)
        if bug is None:
            continue
        try:
            return _assemble(
                rng,
                seed,
                index,
                bug,
                functions_per_repo,
                hidden_per_function,
                pool,
                names,
                rename_locals,
            )
        except ValueError:
            continue
    raise SandboxError(f"could not generate task {index} of seed {seed} for kinds {list(kinds)}")


def _assemble(
    rng: random.Random,
    seed: int,
    index: int,
    bug: Bug,
    functions_per_repo: int,
    hidden_per_function: int,
    pool: Sequence[Template],
    modules: Sequence[str],
    rename_locals: bool,
) -> Task:
    target = bug.target
    module = rng.choice(modules)
    others = rng.sample([t for t in pool if t.name != target.name], functions_per_repo - 1)
    if rename_locals:
        others = [renamed(t, rng) for t in others]
    order = [target, *others]
    rng.shuffle(order)
    fixed_mod = module_source(module, [t.source for t in order])
    buggy_mod = module_source(module, [bug.buggy_src if t is target else t.source for t in order])
    old, new = mutate.fix_edit(fixed_mod, buggy_mod)

    tests = ModuleTests(module, [t.name for t in order])
    case = tests.bug_hidden(bug, hidden_per_function)
    for t in others:
        tests.correct_function(rng, t)
    tests.bug_shown(bug, hidden_per_function, case)
    args, expected, got = bug.example
    instruction = (
        f"There is a bug in `{target.name}` in `{module}.py`: `{call_text(target.name, args)}` "
        f"{outcome_text(got)}, but it should return {expected!r}.\n\n"
        f"Fix `{module}.py` so that `{target.name}` does what its docstring says for every input, "
        "not only this one. Run the visible tests with run_tests, then submit."
    )
    return Task(
        id=f"gen-{seed}-{index}",
        instruction=instruction,
        files={f"{module}.py": buggy_mod, "tests/__init__.py": "", tests.path: tests.text()},
        hidden_tests=HiddenTests(
            fail_to_pass=tuple(tests.f2p),
            pass_to_pass=tuple(tests.p2p + tests.vis),
            reset_paths=(tests.path, "tests/__init__.py"),
            cases=tuple(tests.cases),
        ),
        visible_test_command=VISIBLE_CMD,
        reference_edits=(ReferenceEdit(f"{module}.py", old, new),),
        metadata={
            "source": "generated",
            "bug_kind": bug.kind,
            "function": target.name,
            "mutation": bug.mutation.description,
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
    rename_locals: bool = False,
) -> list[Task]:
    """``n`` generated tasks, numbers ``start .. start + n - 1`` of ``seed``.

    Bug kinds rotate with the index (so any 7 consecutive tasks cover all kinds). Use
    different seeds for training and held-out sets. ``functions`` and ``modules`` narrow the
    task family (the template functions and module names drawn from; default: all), e.g. for
    a curriculum or a small model's demo. ``rename_locals``: see `generate_task`.
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
            rename_locals=rename_locals,
        )
        for i in range(start, start + n)
    ]
