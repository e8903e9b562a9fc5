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
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tandem.agent_env.errors import SandboxError
from tandem.agent_env.task import HiddenTests, Task
from tandem.agent_env.tasks.patch import apply_patch, patched_paths, read_repo_file

_REQUIRED = ("instance_id", "problem_statement", "test_patch", "FAIL_TO_PASS", "repo_path")


def _ids(value: Any, field: str, where: str) -> tuple[str, ...]:
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except json.JSONDecodeError as e:
            raise SandboxError(f"{where}: {field} is not a JSON list: {e}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SandboxError(f"{where}: {field} must be a list of test ids")
    return tuple(value)


def task_from_record(
    record: dict[str, Any], base_dir: Path | None = None, where: str = "record"
) -> Task:
    """One SWE-bench-style record -> Task (the test patch is applied on the host now)."""
    missing = [k for k in _REQUIRED if k not in record]
    if missing:
        raise SandboxError(f"{where}: missing field(s) {missing}; required: {list(_REQUIRED)}")
    repo = Path(record["repo_path"])
    if not repo.is_absolute() and base_dir is not None:
        repo = base_dir / repo
    if not repo.exists():
        raise SandboxError(f"{where}: repo_path {repo} does not exist")
    framework = record.get("test_framework", "pytest")
    if framework not in ("pytest", "unittest"):
        raise SandboxError(
            f"{where}: test_framework must be 'pytest' or 'unittest', got {framework!r}"
        )
    probe = Task(
        id=str(record["instance_id"]),
        instruction="",
        hidden_tests=HiddenTests(()),
        repo_path=str(repo),
    )
    test_patch = record["test_patch"]
    touched = patched_paths(test_patch)
    try:
        after = apply_patch(test_patch, {p: read_repo_file(probe, p) for p in touched})
    except SandboxError as e:
        raise SandboxError(f"{where}: test_patch does not apply to {repo}: {e}") from None
    files = {p: text for p, text in after.items() if text is not None}
    default_cmd = (
        "python3 -m pytest -q" if framework == "pytest" else "python3 -m unittest discover -q"
    )
    return Task(
        id=str(record["instance_id"]),
        instruction=str(record["problem_statement"]),
        repo_path=str(repo),
        hidden_tests=HiddenTests(
            fail_to_pass=_ids(record["FAIL_TO_PASS"], "FAIL_TO_PASS", where),
            pass_to_pass=_ids(record.get("PASS_TO_PASS", []), "PASS_TO_PASS", where),
            files=files,
            reset_paths=tuple(p for p in touched if p not in files),
            framework=framework,
        ),
        visible_test_command=str(record.get("test_command") or default_cmd),
        reference_patch=str(record.get("patch", "")),
        metadata={
            "source": "swebench",
            **{k: str(record[k]) for k in ("repo", "base_commit", "version") if k in record},
        },
    )


def load_tasks(path: str | Path) -> list[Task]:
    """Read SWE-bench-style records (one JSON object per line) as tasks."""
    path = Path(path)
    tasks = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise SandboxError(f"{where}: not valid JSON: {e}") from None
            if not isinstance(record, dict):
                raise SandboxError(f"{where}: expected a JSON object")
            tasks.append(task_from_record(record, path.parent, where))
    return tasks
