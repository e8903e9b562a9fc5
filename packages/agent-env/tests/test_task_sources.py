"""Real-code task sources: bugs in vendored stdlib modules and SWE-bench-style records."""

from __future__ import annotations

import asyncio
import difflib
import json
import random
import shutil
import subprocess
import sys
import tarfile
from collections import Counter
from pathlib import Path

import msgspec
import pytest

from tandem.agent_env import (
    Env,
    EnvConfig,
    OraclePolicy,
    SandboxError,
    TaskFileError,
    ToolCall,
    run_episodes,
    submit_at_once,
)
from tandem.agent_env.config import SandboxConfig
from tandem.agent_env.tasks.patch import apply_patch
from tandem.agent_env.tasks.stdlib import stdlib_tasks
from tandem.agent_env.tasks.swebench import load_tasks


def _rewards(policy, tasks, config: EnvConfig) -> list[float | None]:
    trajs = asyncio.run(run_episodes(policy, tasks, concurrency=8, config=config))
    assert not any(t.infra_fault for t in trajs), [t.grade_detail for t in trajs]
    return [t.reward for t in trajs]


def test_stdlib_tasks_mutate_real_code_and_are_solved_only_by_the_fix(config: EnvConfig) -> None:
    tasks = stdlib_tasks(0, 7)
    assert stdlib_tasks(0, 7) == tasks  # deterministic
    assert len(Counter(t.metadata["bug_kind"] for t in tasks)) == 7
    for t in tasks:
        mod = t.metadata["module"]
        vendored = t.files[f"vendored/{mod}.py"]
        (edit,) = t.reference_edits
        fixed = vendored.replace(edit.old, edit.new)
        stdlib_src = (Path(__import__("sysconfig").get_paths()["stdlib"]) / f"{mod}.py").read_text()
        assert fixed == stdlib_src and vendored != stdlib_src
    assert _rewards(OraclePolicy(tasks), tasks, config) == [1.0] * 7
    assert _rewards(submit_at_once, tasks, config) == [0.0] * 7


def test_patch_applier_agrees_with_gnu_patch(tmp_path: Path) -> None:
    gnu = shutil.which("patch")
    if gnu is None:
        pytest.skip("GNU patch is not installed: no independent implementation to compare with")
    rng = random.Random(0)
    base = [f"line {i} {rng.random():.3f}" for i in range(60)]
    for trial in range(25):
        new = list(base)
        for _ in range(rng.randint(1, 6)):
            i = rng.randrange(len(new))
            op = rng.choice(["del", "ins", "chg"])
            if op == "del":
                del new[i]
            elif op == "ins":
                new.insert(i, f"inserted {trial} {i}")
            else:
                new[i] = new[i] + " changed"
        old_text, new_text = "\n".join(base) + "\n", "\n".join(new) + "\n"
        diff = "".join(
            difflib.unified_diff(
                old_text.splitlines(True),
                new_text.splitlines(True),
                "a/f.txt",
                "b/f.txt",
                n=rng.randint(0, 3),
            )
        )
        if not diff:
            continue
        (tmp_path / "f.txt").write_text(old_text)
        subprocess.run(
            [gnu, "-p1", "-s", "--no-backup-if-mismatch"],
            input=diff,
            text=True,
            cwd=tmp_path,
            check=True,
        )
        assert (
            apply_patch(diff, {"f.txt": old_text})["f.txt"]
            == (tmp_path / "f.txt").read_text()
            == new_text
        )


def test_patch_that_does_not_apply_is_an_error() -> None:
    diff = "--- a/f.txt\n+++ b/f.txt\n@@ -1,2 +1,2 @@\n-nope\n+yes\n same\n"
    with pytest.raises(SandboxError, match="does not apply"):
        apply_patch(diff, {"f.txt": "something else\nsame\n"})


REPO = {
    "shapes/__init__.py": "",
    "shapes/area.py": "def rect(w, h):\n    return w + h\n\n\ndef square(s):\n    return s * s\n",
    "tests/__init__.py": "",
    "tests/test_area.py": (
        "import unittest\n\nfrom shapes.area import square\n\n\nclass TestArea(unittest.TestCase):\n"
        "    def test_square(self):\n        self.assertEqual(square(3), 9)\n"
    ),
}
FIX = "--- a/shapes/area.py\n+++ b/shapes/area.py\n@@ -1,2 +1,2 @@\n def rect(w, h):\n-    return w + h\n+    return w * h\n"
TEST_PATCH = (
    "--- a/tests/test_area.py\n+++ b/tests/test_area.py\n@@ -1,8 +1,11 @@\n import unittest\n \n"
    "-from shapes.area import square\n+from shapes.area import rect, square\n \n \n"
    " class TestArea(unittest.TestCase):\n     def test_square(self):\n         self.assertEqual(square(3), 9)\n"
    "+\n+    def test_rect(self):\n+        self.assertEqual(rect(2, 5), 10)\n"
)


def _write_repo(root: Path) -> None:
    for p, text in REPO.items():
        (root / p).parent.mkdir(parents=True, exist_ok=True)
        (root / p).write_text(text)


def _records(tmp_path: Path, framework: str, f2p: list[str], p2p: list[str]) -> Path:
    _write_repo(tmp_path / "repo")
    with tarfile.open(tmp_path / "repo.tar.gz", "w:gz") as tf:
        tf.add(tmp_path / "repo", arcname="shapes-1.0")
    lines = []
    for i, snapshot in enumerate(["repo", "repo.tar.gz"]):
        rec = {
            "instance_id": f"shapes__shapes-{i}",
            "repo": "example/shapes",
            "base_commit": "0" * 40,
            "problem_statement": "rect() returns the wrong area: rect(2, 5) gives 7.",
            "patch": FIX,
            "test_patch": TEST_PATCH,
            "FAIL_TO_PASS": json.dumps(f2p),
            "PASS_TO_PASS": p2p,
            "repo_path": snapshot,
            "test_framework": framework,
        }
        lines.append(json.dumps(rec))
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_swebench_records_from_a_directory_and_an_archive(
    config: EnvConfig, tmp_path: Path
) -> None:
    path = _records(
        tmp_path,
        "unittest",
        ["tests.test_area.TestArea.test_rect"],
        ["tests.test_area.TestArea.test_square"],
    )
    tasks = load_tasks(path)
    assert [t.id for t in tasks] == ["shapes__shapes-0", "shapes__shapes-1"]
    assert "test_rect" in tasks[0].hidden_tests.files["tests/test_area.py"]
    assert tasks[0].metadata == {
        "source": "swebench",
        "repo": "example/shapes",
        "base_commit": "0" * 40,
    }
    assert _rewards(OraclePolicy(tasks), tasks, config) == [1.0, 1.0]
    assert _rewards(submit_at_once, tasks, config) == [0.0, 0.0]


def _pytest_task(
    sandbox: SandboxConfig, config: EnvConfig, tmp_path: Path
) -> tuple[EnvConfig, Path]:
    """A SWE-bench record run by pytest, with the config that binds this environment's
    site-packages (where pytest is) read-only into ``sandbox``."""
    site = next(
        p for p in sys.path if p.endswith("site-packages") and (Path(p) / "pytest").is_dir()
    )
    bound = msgspec.structs.replace(
        sandbox, ro_binds=(site,), python_paths=(site,), env={"PYTHONPATH": site}
    )
    path = _records(
        tmp_path,
        "pytest",
        ["tests/test_area.py::TestArea::test_rect"],
        ["tests/test_area.py::TestArea::test_square"],
    )
    return msgspec.structs.replace(config, sandbox=bound), path


def test_swebench_pytest_records_with_a_bound_site_packages(
    config: EnvConfig, tmp_path: Path
) -> None:
    """pytest comes from this environment's site-packages, bound read-only into the sandbox."""
    limits = msgspec.structs.replace(config.sandbox.limits, command_timeout_s=60.0)
    cfg, path = _pytest_task(
        msgspec.structs.replace(config.sandbox, limits=limits), config, tmp_path
    )
    tasks = load_tasks(path)[:1]
    trajs = asyncio.run(run_episodes(OraclePolicy(tasks), tasks, concurrency=1, config=cfg))
    assert trajs[0].reward == 1.0, trajs[0].grade_detail
    assert trajs[0].test_results == {
        "tests/test_area.py::TestArea::test_rect": "passed",
        "tests/test_area.py::TestArea::test_square": "passed",
    }
    run_tests_output = next(
        m["content"] for m in trajs[0].messages if m["role"] == "tool" and "passed" in m["content"]
    )
    assert "1 passed" in run_tests_output  # the visible suite: the hidden test is not there


_FORCE_PASS = (
    "import pytest\n\n\n@pytest.hookimpl(hookwrapper=True)\n"
    "def pytest_runtest_makereport(item, call):\n"
    "    outcome = yield\n"
    "    report = outcome.get_result()\n"
    "    report.outcome, report.longrepr = 'passed', None\n"
)


def test_pytest_hooks_and_plugins_the_agent_adds_do_not_count(
    config: EnvConfig, tmp_path: Path
) -> None:
    """A conftest.py hook and a pytest.ini that loads a plugin of the agent's, both rewriting
    every outcome to passed, with the bug left in place: the reward stays 0."""
    cfg, path = _pytest_task(config.sandbox, config, tmp_path)
    task = load_tasks(path)[0]
    files = {
        "conftest.py": _FORCE_PASS,
        "tests/conftest.py": _FORCE_PASS,
        "agentplugin.py": _FORCE_PASS,
        "pytest.ini": "[pytest]\naddopts = -p agentplugin\n",
    }

    async def go() -> float | None:
        async with Env(task, cfg) as env:
            await env.reset()
            for p, text in files.items():
                await env.step(ToolCall("write_file", json.dumps({"path": p, "content": text})))
            return (await env.step(ToolCall("submit"))).reward

    assert asyncio.run(go()) == 0.0


def test_bad_records_explain_what_is_wrong(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"instance_id": "x", "problem_statement": "p"}) + "\n")
    with pytest.raises(TaskFileError, match=r"bad.jsonl:1: missing field\(s\)"):
        load_tasks(path)
    path.write_text("{not json\n")
    with pytest.raises(TaskFileError, match=r"bad\.jsonl:1: not valid JSON"):
        load_tasks(path)
