"""Bugs injected into real code: pure-Python modules of the standard library.

The module's source (from the running interpreter) is vendored into a small repository as
``vendored/<module>.py``, one function of it is mutated, and the hidden tests compare the
vendored function against the original on generated inputs (expected values come from the
unmutated source). Only modules without a C accelerator that would replace the Python code
are used. Tasks depend on the interpreter's minor version (recorded in metadata); the
sandbox's Python should be the same minor version.
"""

from __future__ import annotations

import random
import string
import sys
import sysconfig
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tandem.agent_env.errors import SandboxError
from tandem.agent_env.task import HiddenTests, ReferenceEdit, Task
from tandem.agent_env.tasks import execute, mutate
from tandem.agent_env.tasks.generate import _literal, hidden_case


@dataclass(frozen=True)
class Target:
    module: str
    mutate: str  # the function whose body gets the bug
    call: str  # the public function the tests call (may reach ``mutate`` indirectly)
    inputs: Callable[[random.Random], tuple]


def _unit(r: random.Random) -> float:
    return round(r.random(), 2)


def _path(r: random.Random) -> str:
    parts = [r.choice(["a", "b", "..", ".", "", "src", "x.py"]) for _ in range(r.randint(1, 6))]
    return ("/" if r.random() < 0.5 else "") + "/".join(parts)


def _words(r: random.Random) -> str:
    return " ".join(
        "".join(r.choice(string.ascii_letters) for _ in range(r.randint(1, 9)))
        for _ in range(r.randint(0, 12))
    )


TARGETS: list[Target] = [
    Target("colorsys", "rgb_to_hsv", "rgb_to_hsv", lambda r: (_unit(r), _unit(r), _unit(r))),
    Target("colorsys", "rgb_to_hls", "rgb_to_hls", lambda r: (_unit(r), _unit(r), _unit(r))),
    Target("colorsys", "hls_to_rgb", "hls_to_rgb", lambda r: (_unit(r), _unit(r), _unit(r))),
    Target("colorsys", "hsv_to_rgb", "hsv_to_rgb", lambda r: (_unit(r), _unit(r), _unit(r))),
    Target("posixpath", "normpath", "normpath", lambda r: (_path(r),)),
    Target("posixpath", "relpath", "relpath", lambda r: ("/" + _path(r), "/" + _path(r))),
    Target("posixpath", "join", "join", lambda r: (_path(r), _path(r))),
    Target("textwrap", "_wrap_chunks", "wrap", lambda r: (_words(r), r.randint(4, 20))),
    Target(
        "calendar",
        "leapdays",
        "leapdays",
        lambda r: tuple(sorted((r.randint(1800, 2200), r.randint(1800, 2200)))),
    ),
    Target(
        "calendar",
        "isleap",
        "isleap",
        lambda r: (r.choice([r.randint(1, 2400), r.choice([1900, 2000, 2024, 2100])]),),
    ),
    Target(
        "statistics",
        "median",
        "median",
        lambda r: ([r.randint(-50, 50) for _ in range(r.randint(1, 9))],),
    ),
    Target(
        "statistics",
        "median_high",
        "median_high",
        lambda r: ([r.randint(-50, 50) for _ in range(r.randint(1, 9))],),
    ),
    Target("string", "capwords", "capwords", lambda r: (_words(r).lower(),)),
    Target(
        "fnmatch",
        "translate",
        "translate",
        lambda r: ("".join(r.choice("ab*?[]!.") for _ in range(r.randint(1, 7))),),
    ),
]


def _source(module: str) -> str:
    """The module's source file in the interpreter's stdlib directory (some, like posixpath,
    are imported frozen, but their source ships alongside)."""
    path = Path(sysconfig.get_paths()["stdlib"]) / f"{module}.py"
    if not path.is_file():
        raise SandboxError(f"no pure-Python source for stdlib module {module!r} at {path}")
    return path.read_text(encoding="utf-8")


def stdlib_task(
    seed: int, index: int, kinds: Sequence[str] = mutate.BUG_KINDS, n_tests: int = 8
) -> Task:
    """Task ``index`` of ``seed``: one bug in one vendored stdlib function (deterministic for a
    given interpreter version)."""
    rng = random.Random(f"tandem-agent-env-stdlib:{seed}:{index}")
    for attempt in range(300):
        kind = kinds[(index + attempt // 30) % len(kinds)]
        target = rng.choice(TARGETS)
        original = _source(target.module)
        cands = mutate.candidates(original, target.mutate, kind)
        if not cands:
            continue
        m = mutate.pick(rng, cands)
        try:
            buggy = mutate.apply(original, m)
        except SyntaxError:
            continue
        ref = execute.load(original, target.module)
        bug = execute.load(buggy, target.module)
        seen: dict[str, tuple] = {}
        for _ in range(n_tests * 6):
            args = target.inputs(rng)
            seen.setdefault(repr(args), args)
        f2p, p2p, example, rejected = [], [], None, False
        for args in seen.values():
            want = execute.call(ref, target.call, args)
            if want[0] != "ok":
                continue
            try:
                _literal(want[1])
            except (ValueError, SyntaxError):
                continue
            got = execute.call(bug, target.call, args)
            if got[0] == "budget":
                rejected = True
                break
            (p2p if execute.same(want, got) else f2p).append((args, want[1]))
            if not execute.same(want, got) and example is None:
                example = (args, want[1], got)
        if rejected or example is None:
            continue
        return _assemble(
            seed, index, kind, m, target, original, buggy, f2p[:n_tests], p2p[:4], example
        )
    raise SandboxError(f"could not generate stdlib task {index} of seed {seed}")


def _assemble(seed, index, kind, m, target, original, buggy, f2p, p2p, example) -> Task:
    mod, fn = target.module, target.call
    imports = f"from vendored import {mod}"
    cases = []
    ids_f2p, ids_p2p = [], []
    for i, (args, expected) in enumerate([*f2p, *p2p]):
        call = f"{mod}.{fn}({', '.join(_literal(a) for a in args)})"
        (ids_f2p if i < len(f2p) else ids_p2p).append(f"tests.test_hidden.HiddenTests.test_{i}")
        cases.append(
            hidden_case(f"tests.test_hidden.HiddenTests.test_{i}", imports, call, expected)
        )
    imported = "tests.test_vendored.TestImport.test_imports"
    cases.append(hidden_case(imported, imports, f"callable({mod}.{fn})", True))
    visible = (
        "import unittest\n\n\nclass TestImport(unittest.TestCase):\n"
        f"    def test_imports(self):\n        from vendored import {mod}\n\n"
        f"        self.assertTrue(callable({mod}.{fn}))\n"
    )
    old, new = mutate.fix_edit(original, buggy)
    args, expected, got = example
    shown = f"`{mod}.{fn}({', '.join(_literal(a) for a in args)})`"
    outcome = f"raises {got[1]}" if got[0] == "raise" else f"returns {got[1]!r}"
    instruction = (
        f"`vendored/{mod}.py` is a vendored copy of the standard library's `{mod}` module, and "
        f"a bug has crept into it: {shown} {outcome}, but the standard library returns "
        f"{expected!r}.\n\nFind and fix the bug in `vendored/{mod}.py` (do not import the "
        "standard library's module instead). Then submit."
    )
    return Task(
        id=f"stdlib-{seed}-{index}",
        instruction=instruction,
        files={
            f"vendored/{mod}.py": buggy,
            "vendored/__init__.py": "",
            "tests/__init__.py": "",
            "tests/test_vendored.py": visible,
        },
        hidden_tests=HiddenTests(
            fail_to_pass=tuple(ids_f2p),
            pass_to_pass=(*ids_p2p, imported),
            cases=tuple(cases),
            reset_paths=("tests/test_vendored.py", "tests/__init__.py"),
        ),
        reference_edits=(ReferenceEdit(f"vendored/{mod}.py", old, new),),
        metadata={
            "source": "stdlib",
            "module": mod,
            "function": target.mutate,
            "bug_kind": kind,
            "mutation": m.description,
            "python": f"{sys.version_info.major}.{sys.version_info.minor}",
            "seed": str(seed),
            "index": str(index),
        },
    )


def stdlib_tasks(
    seed: int, n: int, *, start: int = 0, kinds: Sequence[str] = mutate.BUG_KINDS
) -> list[Task]:
    """``n`` tasks with a bug injected into real standard-library code."""
    return [stdlib_task(seed, i, kinds) for i in range(start, start + n)]
