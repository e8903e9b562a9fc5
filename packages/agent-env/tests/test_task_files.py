"""Malformed task files are data errors that name the file and the line, never SandboxError."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tandem.agent_env import SandboxError, TaskFileError, load_tasks

TEST_PATCH = (
    "--- /dev/null\n+++ b/tests/test_hidden.py\n@@ -0,0 +1,2 @@\n+import unittest\n+X = 1\n"
)


def _record(**changes: Any) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "instance_id": "calc-1",
        "problem_statement": "add() subtracts.",
        "patch": "",
        "test_patch": TEST_PATCH,
        "FAIL_TO_PASS": '["tests.test_hidden.H.test_add"]',
        "PASS_TO_PASS": [],
        "repo_path": "repo",
    }
    rec.update(changes)
    return {k: v for k, v in rec.items() if v is not ...}


@pytest.fixture
def task_file(tmp_path: Path) -> Path:
    (tmp_path / "repo" / "tests").mkdir(parents=True)
    (tmp_path / "repo" / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (tmp_path / "repo" / "tests" / "__init__.py").write_text("")
    return tmp_path / "tasks.jsonl"


def _error(path: Path, lines: list[str | bytes]) -> TaskFileError:
    path.write_bytes(b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines))
    with pytest.raises(TaskFileError) as e:
        load_tasks(path)
    return e.value


def test_a_good_file_loads(task_file: Path) -> None:
    task_file.write_text(json.dumps(_record()) + "\n\n" + json.dumps(_record(instance_id="b")))
    assert [t.id for t in load_tasks(task_file)] == ["calc-1", "b"]


def test_invalid_json_names_file_and_line(task_file: Path) -> None:
    err = _error(task_file, [json.dumps(_record()), "", '{"instance_id": "x",'])
    assert isinstance(err, ValueError) and not isinstance(err, SandboxError)
    assert (err.path, err.line) == (task_file, 3)
    assert str(err).startswith(f"{task_file}:3: ") and "not valid JSON" in str(err)


def test_invalid_utf8_names_the_line(task_file: Path) -> None:
    err = _error(task_file, [json.dumps(_record()), b'{"instance_id": "\xff"}'])
    assert err.line == 2 and "UTF-8" in str(err)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("[1, 2]", "expected a JSON object, got an array"),
        ('"calc-1"', "expected a JSON object, got a string"),
        ("null", "expected a JSON object, got null"),
    ],
)
def test_a_line_that_is_not_an_object(task_file: Path, line: str, expected: str) -> None:
    err = _error(task_file, [json.dumps(_record()), line])
    assert err.line == 2 and expected in str(err), str(err)


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"instance_id": ...}, "missing field(s) ['instance_id']"),
        ({"FAIL_TO_PASS": ..., "repo_path": ...}, "missing field(s) ['FAIL_TO_PASS', 'repo_path']"),
        ({"instance_id": 7}, "instance_id must be a non-empty string, got a number"),
        ({"instance_id": ""}, "instance_id must be a non-empty string, got an empty string"),
        ({"problem_statement": None}, "problem_statement must be a string, got null"),
        ({"test_patch": ["x"]}, "test_patch must be a string, got an array"),
        ({"repo_path": 3}, "repo_path must be a non-empty string, got a number"),
        ({"FAIL_TO_PASS": "tests.x"}, "FAIL_TO_PASS is not a JSON list"),
        ({"FAIL_TO_PASS": [1]}, "FAIL_TO_PASS must be a list of test ids"),
        ({"PASS_TO_PASS": {"a": 1}}, "PASS_TO_PASS must be a list of test ids"),
        ({"patch": 1}, "patch must be a string, got a number"),
        ({"test_framework": "nose"}, "test_framework must be 'pytest' or 'unittest'"),
        ({"test_command": 5}, "test_command must be a string, got a number"),
        ({"repo_path": "nowhere"}, "does not exist"),
        ({"test_patch": "--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-a\n+b\n"}, "does not apply"),
    ],
)
def test_missing_or_ill_typed_fields(task_file: Path, changes: dict, expected: str) -> None:
    err = _error(task_file, [json.dumps(_record()), json.dumps(_record(**changes))])
    assert (err.path, err.line) == (task_file, 2)
    assert str(err).startswith(f"{task_file}:2: ") and expected in str(err), str(err)
