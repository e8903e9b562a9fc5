"""Generated long-horizon tasks: a repository of several modules, several of them buggy.

Each task is a repository of ``modules`` small modules (distinct names, ``functions_per_module``
template functions each, no function in two modules), one visible unittest file per module,
and hidden tests for every function. Exactly ``buggy`` of the modules hold one injected bug
each (the same checked mutations as `generate_tasks`); the rest are correct. The instruction
lists every failing behaviour (function, a call, what it returns and what it should) but no
file: the agent has to find where each function lives, which makes these episodes long (the
oracle needs ``2 * buggy + 4`` tool calls, 12 with the defaults, against 5 for one bug).

Task ``i`` of seed ``s`` depends only on (s, i) and the settings, so held-out sets are other
seeds, and ids (``multibug-<seed>-<index>``) never collide with `generate_tasks`' ``gen-...``.

Reward: this family is meant to be graded with ``EnvConfig(partial_credit=True)``, whose
reward is the fraction of hidden tests that pass. With four bugs, all-or-nothing pays only
for fixing all four in one episode, which a small policy rarely does, so nearly every group
of episodes scores all zeros and gives no learning signal; with partial credit every fixed
bug raises the reward by its share of the hidden tests (and breaking a correct module lowers
it). The untouched repository already scores its pass-to-pass share (strictly between 0 and
1); group-relative advantages remove that constant, what remains is the progress. Every
function has hidden tests, so the fraction counts each module's state. All-or-nothing
(``resolved``) stays the success metric to report.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from tandem.agent_env.errors import SandboxError
from tandem.agent_env.task import HiddenTests, ReferenceEdit, Task
from tandem.agent_env.tasks import mutate
from tandem.agent_env.tasks.generate import (
    MODULE_NAMES,
    VISIBLE_CMD,
    Bug,
    ModuleTests,
    call_text,
    inject_bug,
    module_source,
    outcome_text,
)
from tandem.agent_env.tasks.templates import TEMPLATES, Template

MIN_BUGGY = 3
"""Fewest buggy modules: with fewer the task is not long-horizon (the oracle needs
``2 * buggy + 4`` calls, so 3 bugs already take 10)."""

_TASK_ATTEMPTS = 50  # fresh draws of modules and functions before giving up on a task
_TRIES_PER_KIND = 6  # injection tries per bug kind before a module is left correct


def max_modules(functions_per_module: int) -> int:
    """The most modules a repository can have: every module needs its own name and its own
    ``functions_per_module`` template functions."""
    return min(len(MODULE_NAMES), len(TEMPLATES) // max(functions_per_module, 1))


def check_multibug_family(
    modules: int,
    buggy: int,
    functions_per_module: int,
    kinds: Sequence[str],
    hidden_per_function: int,
) -> None:
    """Raise `ValueError`, its message starting with the argument's name, when these settings
    cannot generate tasks (checked once, up front, instead of failing on some task)."""
    if isinstance(kinds, str) or not kinds:
        raise ValueError(f"kinds: give a non-empty sequence of bug kinds from {mutate.BUG_KINDS}")
    bad = [k for k in kinds if k not in mutate.BUG_KINDS]
    if bad:
        raise ValueError(f"kinds: unknown bug kinds {bad}; choose from {mutate.BUG_KINDS}")
    if functions_per_module < 1:
        raise ValueError(f"functions_per_module: must be >= 1, got {functions_per_module}")
    if hidden_per_function < 1:
        raise ValueError(f"hidden_per_function: must be >= 1, got {hidden_per_function}")
    most = max_modules(functions_per_module)
    if not MIN_BUGGY <= modules <= most:
        raise ValueError(
            f"modules: must be in {MIN_BUGGY}..{most} with {functions_per_module} functions per "
            f"module ({len(TEMPLATES)} template functions, {len(MODULE_NAMES)} module names), "
            f"got {modules}"
        )
    if not MIN_BUGGY <= buggy <= modules:
        raise ValueError(f"buggy: must be in {MIN_BUGGY}..modules ({modules}), got {buggy}")


def generate_multibug_tasks(
    seed: int,
    n: int,
    *,
    start: int = 0,
    modules: int = 6,
    buggy: int = 4,
    functions_per_module: int = 2,
    kinds: Sequence[str] = mutate.BUG_KINDS,
    hidden_per_function: int = 8,
) -> list[Task]:
    """``n`` multi-bug tasks, numbers ``start .. start + n - 1`` of ``seed``.

    Bug kinds rotate with the task index and the bug's slot, so a task's bugs are of
    different kinds when ``kinds`` allows it. Use different seeds for training and held-out
    sets, and grade with ``partial_credit`` (see the module docstring).
    """
    check_multibug_family(modules, buggy, functions_per_module, kinds, hidden_per_function)
    return [
        generate_multibug_task(
            seed,
            i,
            modules=modules,
            buggy=buggy,
            functions_per_module=functions_per_module,
            kinds=kinds,
            hidden_per_function=hidden_per_function,
        )
        for i in range(start, start + n)
    ]


def generate_multibug_task(
    seed: int,
    index: int,
    *,
    modules: int = 6,
    buggy: int = 4,
    functions_per_module: int = 2,
    kinds: Sequence[str] = mutate.BUG_KINDS,
    hidden_per_function: int = 8,
) -> Task:
    """Task number ``index`` of ``seed`` (deterministic; settings as `generate_multibug_tasks`).

    Modules are offered a bug in a seeded order until ``buggy`` of them hold one; a module
    none of whose functions can take a visible bug of the allowed kinds stays correct, and
    if too few can, the repository is drawn again.
    """
    check_multibug_family(modules, buggy, functions_per_module, kinds, hidden_per_function)
    rng = random.Random(f"tandem-agent-env:multibug:{seed}:{index}")
    for _ in range(_TASK_ATTEMPTS):
        names = rng.sample(MODULE_NAMES, modules)
        drawn = rng.sample(TEMPLATES, modules * functions_per_module)
        groups = [
            drawn[i * functions_per_module : (i + 1) * functions_per_module] for i in range(modules)
        ]
        bugs: dict[int, Bug] = {}
        for pos in rng.sample(range(modules), modules):
            if len(bugs) == buggy:
                break
            slot = index * buggy + len(bugs)
            bug = _module_bug(rng, groups[pos], kinds, slot, hidden_per_function)
            if bug is not None:
                bugs[pos] = bug
        if len(bugs) < buggy:
            continue
        try:
            return _assemble(rng, seed, index, names, groups, bugs, hidden_per_function)
        except ValueError:  # a value with no literal form, or a function left without tests
            continue
    raise SandboxError(
        f"could not generate multibug task {index} of seed {seed} with {buggy} of {modules} "
        f"modules buggy for kinds {list(kinds)}"
    )


def _module_bug(
    rng: random.Random,
    group: Sequence[Template],
    kinds: Sequence[str],
    slot: int,
    hidden_per_function: int,
) -> Bug | None:
    """One bug in one of ``group``'s functions, its kind rotating from ``kinds[slot]`` on
    when a kind yields none; None when no kind does."""
    for attempt in range(_TRIES_PER_KIND * len(kinds)):
        kind = kinds[(slot + attempt // _TRIES_PER_KIND) % len(kinds)]
        bug = inject_bug(rng, rng.choice(group), kind, hidden_per_function)
        if bug is not None:
            return bug
    return None


def _assemble(
    rng: random.Random,
    seed: int,
    index: int,
    names: Sequence[str],
    groups: Sequence[Sequence[Template]],
    bugs: dict[int, Bug],
    hidden_per_function: int,
) -> Task:
    sources: dict[str, str] = {}
    suites: list[ModuleTests] = []
    edits: list[ReferenceEdit] = []
    for pos, (name, group) in enumerate(zip(names, groups, strict=True)):
        bug = bugs.get(pos)
        tests = ModuleTests(name, [t.name for t in group])
        fixed = module_source(name, [t.source for t in group])
        if bug is None:
            sources[f"{name}.py"] = fixed
            for t in group:
                tests.correct_function(rng, t)
        else:
            buggy_src = module_source(
                name, [bug.buggy_src if t is bug.target else t.source for t in group]
            )
            sources[f"{name}.py"] = buggy_src
            old, new = mutate.fix_edit(fixed, buggy_src)
            edits.append(ReferenceEdit(f"{name}.py", old, new))
            case = tests.bug_hidden(bug, hidden_per_function)
            for t in group:
                if t is not bug.target:
                    tests.correct_function(rng, t)
            tests.bug_shown(bug, hidden_per_function, case)
        tested = {c.imports.rsplit(" ", 1)[-1] for c in tests.cases}
        if tested != {t.name for t in group}:
            raise ValueError(f"{name}: functions without hidden tests")
        suites.append(tests)
    ordered = [bugs[pos] for pos in sorted(bugs)]  # the order of the edits (module order)
    return Task(
        id=f"multibug-{seed}-{index}",
        instruction=_instruction(ordered),
        files={
            **sources,
            "tests/__init__.py": "",
            **{tests.path: tests.text() for tests in suites},
        },
        hidden_tests=HiddenTests(
            fail_to_pass=tuple(i for s in suites for i in s.f2p),
            pass_to_pass=tuple(i for s in suites for i in [*s.p2p, *s.vis]),
            reset_paths=(*(s.path for s in suites), "tests/__init__.py"),
            cases=tuple(c for s in suites for c in s.cases),
        ),
        visible_test_command=VISIBLE_CMD,
        reference_edits=tuple(edits),
        metadata=_metadata(seed, index, len(names), ordered),
    )


def _instruction(bugs: Sequence[Bug]) -> str:
    """Every failing behaviour, and no file or module name: finding the code is the task."""
    lines = []
    for bug in bugs:
        args, expected, got = bug.example
        fn = bug.target.name
        lines.append(
            f"- `{fn}`: `{call_text(fn, args)}` {outcome_text(got)}, "
            f"but it should return {expected!r}.\n"
        )
    return (
        f"This repository has {len(bugs)} bugs, possibly spread over several modules. "
        "These calls misbehave:\n\n"
        + "".join(lines)
        + "\nFind where each of these functions is defined and fix it so that it does what "
        "its docstring says for every input, not only the call shown. The other functions "
        "are correct; leave them as they are. Run the visible tests with run_tests, then "
        "submit."
    )


def _metadata(seed: int, index: int, modules: int, bugs: Sequence[Bug]) -> dict[str, str]:
    """String values only (`Task.metadata`): the family, its size, and each bug in edit order.
    There is no single ``function``/``bug_kind``: a task has several."""
    meta = {
        "source": "multibug",
        "seed": str(seed),
        "index": str(index),
        "modules": str(modules),
        "buggy": str(len(bugs)),
        "functions": ",".join(b.target.name for b in bugs),
        "bug_kinds": ",".join(b.kind for b in bugs),
    }
    for j, b in enumerate(bugs):
        meta[f"bug{j}_function"] = b.target.name
        meta[f"bug{j}_kind"] = b.kind
        meta[f"bug{j}_mutation"] = b.mutation.description
    return meta
