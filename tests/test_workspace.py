"""The workspace layout and dependency rules that DESIGN.md states, checked on the real files."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROOT_TOML = tomllib.loads((ROOT / "pyproject.toml").read_text())
MEMBERS = ROOT_TOML["tool"]["uv"]["workspace"]["members"]
# dist name -> import name, from DESIGN.md
EXPECTED = {
    "packages/moe-determinism": ("tandem-moe-determinism", "tandem.moe_determinism"),
    "packages/grpo": ("tandem-grpo", "tandem.grpo"),
    "packages/delta-sync": ("tandem-delta-sync", "tandem.delta_sync"),
    "packages/agent-env": ("tandem-agent-env", "tandem.agent_env"),
    "packages/orchestrator": ("tandem-orchestrator", "tandem.orchestrator"),
    "packages/vllm-plugin": ("tandem-vllm-plugin", "tandem.vllm_plugin"),
    "apps/tandem": ("tandem-rl", "tandem.app"),
}
LEAVES = ["tandem-moe-determinism", "tandem-grpo", "tandem-delta-sync", "tandem-agent-env"]
TORCH_FREE = ["tandem-delta-sync", "tandem-agent-env"]


def _project(member: str) -> dict:
    return tomllib.loads((ROOT / member / "pyproject.toml").read_text())


def _req_names(reqs: list[str]) -> set[str]:
    return {re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0].lower() for r in reqs}


def test_root_is_virtual_and_lists_every_member() -> None:
    assert "project" not in ROOT_TOML, "the workspace root must not be a package"
    assert sorted(MEMBERS) == sorted(EXPECTED)


@pytest.mark.parametrize("member", sorted(EXPECTED))
def test_member_layout(member: str) -> None:
    dist, module = EXPECTED[member]
    meta = _project(member)
    assert meta["project"]["name"] == dist
    assert meta["project"]["version"] == "0.1.0"
    assert (ROOT / member / "README.md").read_text().strip(), f"{member}/README.md is empty"
    assert any((ROOT / member / "tests").glob("test_*.py")), f"{member}/tests has no tests"
    pkg_dir = ROOT / member / "src" / Path(*module.split("."))
    assert (pkg_dir / "__init__.py").is_file()
    assert not (ROOT / member / "src" / "tandem" / "__init__.py").exists(), "tandem is a namespace"
    assert meta["tool"]["uv"]["build-backend"]["module-name"] == module


@pytest.mark.parametrize("member", sorted(EXPECTED))
def test_siblings_come_from_the_workspace(member: str) -> None:
    meta = _project(member)
    siblings = {
        n for n in _req_names(meta["project"].get("dependencies", [])) if n.startswith("tandem")
    }
    sources = meta.get("tool", {}).get("uv", {}).get("sources", {})
    for name in siblings:
        assert sources.get(name) == {"workspace": True}, f"{member}: {name} needs workspace = true"


@pytest.mark.parametrize("dist", LEAVES)
def test_leaf_packages_import_no_sibling(dist: str) -> None:
    member = next(m for m, (d, _) in EXPECTED.items() if d == dist)
    meta = _project(member)
    deps = _req_names(meta["project"].get("dependencies", []))
    assert not {d for d in deps if d.startswith("tandem")}, f"{dist} must not depend on siblings"
    src = ROOT / member / "src"
    others = [mod for d, mod in EXPECTED.values() if d != dist]
    for path in src.rglob("*.py"):
        text = path.read_text()
        for mod in others:
            assert not re.search(rf"^\s*(from|import)\s+{re.escape(mod)}\b", text, re.M), (
                f"{path.relative_to(ROOT)} imports {mod}"
            )


@pytest.mark.parametrize("dist", TORCH_FREE)
def test_torch_free_packages_do_not_declare_torch(dist: str) -> None:
    member = next(m for m, (d, _) in EXPECTED.items() if d == dist)
    meta = _project(member)
    assert "torch" not in _req_names(meta["project"].get("dependencies", []))


def test_heavy_optional_dependencies_are_extras_only() -> None:
    for member in EXPECTED:
        deps = _req_names(_project(member)["project"].get("dependencies", []))
        assert not deps & {"vllm", "ray", "cupy-cuda12x", "cupy-cuda13x"}, member


def test_lock_file_is_ignored() -> None:
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    for entry in ("uv.lock", ".venv/"):
        assert entry in ignored


@pytest.mark.parametrize("member", sorted(EXPECTED))
def test_member_ships_license_changelog_and_types(member: str) -> None:
    """Each distribution carries the root LICENSE (a link to it), a Keep a Changelog
    CHANGELOG with the current state as 0.1.0, ``py.typed``, classifiers and project URLs."""
    _, module = EXPECTED[member]
    assert (ROOT / member / "LICENSE").read_bytes() == (ROOT / "LICENSE").read_bytes()
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    changelog = (ROOT / member / "CHANGELOG.md").read_text()
    assert "Keep a Changelog" in changelog and "## [Unreleased]" in changelog
    assert re.search(r"^## \[0\.1\.0\] - \d{4}-\d{2}-\d{2}$", changelog, re.M)
    assert (ROOT / member / "src" / Path(*module.split(".")) / "py.typed").is_file()
    project = _project(member)["project"]
    assert project["license-files"] == ["LICENSE"]
    assert "Typing :: Typed" in project["classifiers"]
    assert {"Repository", "Changelog"} <= set(project["urls"])
