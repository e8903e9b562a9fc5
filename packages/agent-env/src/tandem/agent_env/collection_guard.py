"""Files the agent wrote that would change how hidden tests are collected or imported.

Grading stacks the hidden tests over the agent's final workspace. Some files there act on the
test machinery itself rather than on the code under test: ``conftest.py`` and test
configuration (``pytest.ini``, ``tox.ini``, ``setup.cfg``, ``pyproject.toml``),
``sitecustomize``/``usercustomize``, ``.pth`` files and package metadata (pytest plugins are
found through ``*.dist-info`` entry points), bytecode (``__pycache__``, ``*.pyc``: a ``.pyc``
with an unchecked hash is loaded whatever the source says), and anything next to a hidden or
reset test module that Python would import instead of it (a package directory of the same
name, an extension module, a ``.pyc``).

For grading, each such path among the agent's writes is restored from the task's base when the
base has it (a pristine copy in the hidden layer on top) and removed otherwise (by the test
runner, before any of the agent's code is imported).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from tandem.agent_env.task import Task

_NAMES = frozenset(
    {
        "conftest.py",
        "pytest.ini",
        "tox.ini",
        "setup.cfg",
        "pyproject.toml",
        "sitecustomize.py",
        "usercustomize.py",
        "__pycache__",
        ".pytest_cache",
    }
)
_SUFFIXES = (".pth", ".pyc", ".pyo", ".dist-info", ".egg-info", ".egg-link")


def _shadows(rel: str, modules: frozenset[str]) -> bool:
    """Whether ``rel`` would be imported instead of one of ``modules`` (paths without .py)."""
    stem = rel.split(".", 1)[0] if "." in os.path.basename(rel) else rel
    return stem in modules and rel != stem + ".py"


def guarded_writes(writes: Path, task: Task) -> list[str]:
    """Paths (relative) among the agent's writes that act on the test machinery."""
    hidden = task.hidden_tests
    modules = frozenset(p[:-3] for p in (*hidden.files, *hidden.reset_paths) if p.endswith(".py"))
    found: list[str] = []
    for root, dirs, files in os.walk(writes):
        rel_root = os.path.relpath(root, writes)
        for name in [*dirs, *files]:
            rel = name if rel_root == "." else f"{rel_root}/{name}"
            if name in _NAMES or name.endswith(_SUFFIXES) or _shadows(rel, modules):
                found.append(rel)
        dirs[:] = [d for d in dirs if (d if rel_root == "." else f"{rel_root}/{d}") not in found]
    return found


def guard(
    writes: Path, base: Path, hidden_dir: Path, task: Task
) -> tuple[list[str], dict[str, str]]:
    """Restore guarded paths from ``base`` into ``hidden_dir`` where the base has them; return
    the ones to remove and the content hashes of the hidden files (checked in the sandbox)."""
    remove = []
    for rel in guarded_writes(writes, task):
        src, dst = base / rel, hidden_dir / rel
        if dst.exists() or dst.is_symlink():
            continue  # the hidden layer lays it already
        if src.is_dir() and not src.is_symlink():
            shutil.copytree(src, dst, symlinks=True)
        elif src.exists() or src.is_symlink():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst, follow_symlinks=False)
        else:
            remove.append(rel)
    hashes = {
        rel: hashlib.sha256((hidden_dir / rel).read_bytes()).hexdigest()
        for rel in task.hidden_tests.files
    }
    return remove, hashes
