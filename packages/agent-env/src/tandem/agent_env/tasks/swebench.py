"""SWE-bench-style task records from JSONL.

Each line is an object with the SWE-bench fields ``instance_id``, ``problem_statement``,
``patch`` (the reference fix), ``test_patch`` (adds or changes the tests that decide the
reward), ``FAIL_TO_PASS`` and ``PASS_TO_PASS`` (lists, or JSON strings of lists, as in the
published datasets), plus the repository snapshot, which SWE-bench leaves to a Docker image:
``repo_path`` (a directory or a .tar/.tar.gz/.tgz/.zip archive of the repository at
``base_commit``; relative paths are resolved against the JSONL file's directory). Optional:
``test_framework`` (``pytest``, the default, or ``unittest``) and ``test_command`` (what
``run_tests`` runs). pytest must be importable by the sandbox's interpreter: bind a
site-packages directory with ``SandboxConfig(ro_binds=..., python_paths=...)``.

A line that is not a well-formed record raises `TaskFileError` (a ``ValueError``) naming the
file and the line: invalid UTF-8 or JSON, not an object, a required field missing, a field of
the wrong type, a ``repo_path`` that does not exist, a ``test_patch`` that does not apply.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tandem.agent_env.errors import SandboxError, TaskFileError
from tandem.agent_env.task import HiddenTests, Task
from tandem.agent_env.tasks.patch import apply_patch, patched_paths, read_repo_file

_REQUIRED = ("instance_id", "problem_statement", "test_patch", "FAIL_TO_PASS", "repo_path")


class _Bad(Exception):
    """What is wrong with one record (the caller adds where it is)."""


def _kind(value: Any) -> str:
    """The JSON kind of a decoded value, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "an empty string" if not value else "a string"
    return "an array" if isinstance(value, list) else "an object"


def _str(record: dict[str, Any], field: str, *, required: bool, nonempty: bool = False) -> str:
    value = record.get(field)
    if value is None and not required:
        return ""
    if isinstance(value, str) and (value or not nonempty):
        return value
    want = "a non-empty string" if nonempty else "a string"
    raise _Bad(f"{field} must be {want}, got {_kind(value)}")


def _ids(value: Any, field: str) -> tuple[str, ...]:
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except json.JSONDecodeError as e:
            raise _Bad(f"{field} is not a JSON list: {e}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _Bad(f"{field} must be a list of test ids (or a JSON string of one)")
    return tuple(value)


def _task(record: Any, base_dir: Path | None) -> Task:
    if not isinstance(record, dict):
        raise _Bad(f"expected a JSON object, got {_kind(record)}")
    missing = [k for k in _REQUIRED if k not in record]
    if missing:
        raise _Bad(f"missing field(s) {missing}; required: {list(_REQUIRED)}")
    instance_id = _str(record, "instance_id", required=True, nonempty=True)
    statement = _str(record, "problem_statement", required=True)
    test_patch = _str(record, "test_patch", required=True)
    repo_text = _str(record, "repo_path", required=True, nonempty=True)
    fail_to_pass = _ids(record["FAIL_TO_PASS"], "FAIL_TO_PASS")
    pass_to_pass = _ids(record.get("PASS_TO_PASS", []), "PASS_TO_PASS")
    patch = _str(record, "patch", required=False)
    command = _str(record, "test_command", required=False)
    framework = record.get("test_framework", "pytest")
    if framework not in ("pytest", "unittest"):
        raise _Bad(f"test_framework must be 'pytest' or 'unittest', got {framework!r}")
    repo = Path(repo_text)
    if not repo.is_absolute() and base_dir is not None:
        repo = base_dir / repo
    if not repo.exists():
        raise _Bad(f"repo_path {repo} does not exist")
    probe = Task(id=instance_id, instruction="", hidden_tests=HiddenTests(()), repo_path=str(repo))
    touched = patched_paths(test_patch)
    try:
        after = apply_patch(test_patch, {p: read_repo_file(probe, p) for p in touched})
    except SandboxError as e:
        raise _Bad(f"test_patch does not apply to {repo}: {e}") from None
    files = {p: text for p, text in after.items() if text is not None}
    default_cmd = (
        "python3 -m pytest -q" if framework == "pytest" else "python3 -m unittest discover -q"
    )
    return Task(
        id=instance_id,
        instruction=statement,
        repo_path=str(repo),
        hidden_tests=HiddenTests(
            fail_to_pass=fail_to_pass,
            pass_to_pass=pass_to_pass,
            files=files,
            reset_paths=tuple(p for p in touched if p not in files),
            framework=framework,
        ),
        visible_test_command=command or default_cmd,
        reference_patch=patch,
        metadata={
            "source": "swebench",
            **{k: str(record[k]) for k in ("repo", "base_commit", "version") if k in record},
        },
    )


def task_from_record(
    record: dict[str, Any], base_dir: Path | None = None, where: str = "record"
) -> Task:
    """One SWE-bench-style record -> Task (the test patch is applied on the host now).

    Raises `TaskFileError` (a ``ValueError``) saying ``where`` and what is wrong."""
    try:
        return _task(record, base_dir)
    except _Bad as e:
        raise TaskFileError(where, str(e)) from None


def load_tasks(path: str | Path) -> list[Task]:
    """Read SWE-bench-style records (one JSON object per line; blank lines are skipped).

    A line that is not valid UTF-8 or JSON, not an object, or lacks a required field or has
    one of the wrong type raises `TaskFileError` naming the file and the line."""
    path = Path(path)
    tasks = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise _Bad(f"not valid UTF-8 (byte {e.start + 1} of the line)") from None
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise _Bad(f"not valid JSON: {e}") from None
                tasks.append(_task(record, path.parent))
            except _Bad as e:
                raise TaskFileError(f"{path}:{n}", str(e), path, n) from None
    return tasks
