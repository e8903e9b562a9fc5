"""The orchestrator's wings keep to their roles: checked on the imports of the real files.

The RL loop drives engines, trainers and backends only through protocols, wire types and
config; training never imports inference; the app uses only the package's public face.
Every wing says what it holds, and no module grows past one screenful of concepts.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import tandem.orchestrator as orchestrator

SRC = Path(orchestrator.__file__).resolve().parent
APP = SRC.parents[4] / "apps" / "tandem" / "src" / "tandem" / "app"
WINGS = sorted(p.name for p in SRC.iterdir() if (p / "__init__.py").is_file())

# wing -> the wings (and top-level modules) of the orchestrator it must not import
FORBIDDEN = {
    "rl": {"inference", "rollout", "training", "backends", "midtrain", "eval", "stages", "policy"},
    "training": {"inference", "rollout", "rl", "backends", "midtrain", "eval", "stages"},
    "inference": {"rollout", "training", "rl", "backends", "midtrain", "eval", "stages"},
    "rollout": {"training", "rl", "backends", "midtrain", "eval", "stages"},
    "artifacts": {"inference", "rollout", "training", "rl", "backends", "midtrain", "eval"},
    "runtime": {"inference", "rollout", "training", "rl", "backends", "midtrain", "eval"},
}


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (function-local imports included)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def orchestrator_parts(path: Path) -> set[str]:
    """The first component under ``tandem.orchestrator`` of everything ``path`` imports."""
    prefix = "tandem.orchestrator."
    return {m[len(prefix) :].split(".")[0] for m in imported_modules(path) if m.startswith(prefix)}


def test_the_wings_are_the_documented_ones() -> None:
    assert WINGS == [
        "artifacts",
        "backends",
        "eval",
        "inference",
        "midtrain",
        "rl",
        "rollout",
        "runtime",
        "training",
    ]


@pytest.mark.parametrize("wing", sorted(FORBIDDEN))
def test_a_wing_imports_only_what_its_role_allows(wing: str) -> None:
    for path in sorted((SRC / wing).rglob("*.py")):
        bad = orchestrator_parts(path) & FORBIDDEN[wing]
        assert not bad, f"{path.relative_to(SRC)} imports {sorted(bad)}"


def test_the_loop_imports_only_protocols_wire_types_and_config() -> None:
    allowed = {"protocols", "wire", "config", "rl", "artifacts", "runtime"}
    parts = orchestrator_parts(SRC / "rl" / "loop.py")
    assert parts <= allowed, sorted(parts - allowed)
    assert "torch" not in {m.split(".")[0] for m in imported_modules(SRC / "rl" / "loop.py")}


def test_the_app_imports_only_the_public_face() -> None:
    for path in sorted(APP.glob("*.py")):
        deep = {m for m in imported_modules(path) if m.startswith("tandem.orchestrator.")}
        names = {m.rsplit(".", 1)[-1] for m in deep}
        assert names <= set(orchestrator.__all__), f"{path.name} imports {sorted(deep)}"


def test_every_public_name_resolves() -> None:
    for name in orchestrator.__all__:
        assert getattr(orchestrator, name) is not None, name


@pytest.mark.parametrize("wing", WINGS)
def test_every_wing_says_what_it_holds(wing: str) -> None:
    doc = ast.get_docstring(ast.parse((SRC / wing / "__init__.py").read_text()))
    assert doc and len(doc.split()) >= 15, f"{wing}/__init__.py needs a docstring"


def test_no_module_is_over_400_lines() -> None:
    long = {
        str(p.relative_to(SRC)): n
        for p in SRC.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 400
    }
    assert not long, long
