"""Scripted policies: the oracle (applies the reference fix through the tools) and a
submit-at-once baseline. Both are ordinary async policies ``messages -> ToolCall``.

The oracle is stateless: it finds its task from the instruction in the conversation and its
position from the number of tool calls so far, so one instance serves any number of
concurrent episodes. Its transcripts are worked examples for mid-training.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from tandem.agent_env.errors import SandboxError
from tandem.agent_env.task import Task
from tandem.agent_env.tasks.patch import apply_patch, patched_paths, read_repo_file
from tandem.agent_env.tools import ToolCall


def _call(name: str, **args: Any) -> ToolCall:
    return ToolCall(name=name, arguments=json.dumps(args))


def oracle_script(task: Task) -> list[ToolCall]:
    """The tool calls that demonstrate the task's reference fix."""
    calls: list[ToolCall] = [_call("list_dir", path=".", depth=2)]
    if task.reference_edits:
        for path in dict.fromkeys(e.path for e in task.reference_edits):
            calls.append(_call("read_file", path=path))
        calls += [
            _call("edit", path=e.path, old_string=e.old, new_string=e.new)
            for e in task.reference_edits
        ]
    elif task.reference_patch:
        for path in patched_paths(task.reference_patch):
            before = read_repo_file(task, path)
            after = apply_patch(task.reference_patch, {path: before})[path]
            if before is not None:
                calls.append(_call("read_file", path=path))
            if after is None:
                calls.append(_call("bash", command=f"rm -f -- '{path}'"))
            else:
                calls.append(_call("write_file", path=path, content=after))
    else:
        raise SandboxError(
            f"task {task.id} has no reference fix (reference_edits or reference_patch)"
        )
    return [*calls, _call("run_tests"), _call("submit")]


class OraclePolicy:
    """Applies each task's reference fix through the tools, then runs the tests and submits."""

    def __init__(self, tasks: Iterable[Task]) -> None:
        self._scripts: dict[str, list[ToolCall]] = {}
        self._tasks = {t.instruction: t for t in tasks}

    async def __call__(self, messages: list[dict[str, Any]]) -> ToolCall:
        instruction = next((m["content"] for m in messages if m.get("role") == "user"), None)
        task = self._tasks.get(instruction or "")
        if task is None:
            raise SandboxError("OraclePolicy was not given the task of this conversation")
        script = self._scripts.get(task.id)
        if script is None:
            script = self._scripts[task.id] = oracle_script(task)
        done = sum(1 for m in messages if m.get("role") == "assistant")
        return script[min(done, len(script) - 1)]


async def submit_at_once(messages: list[dict[str, Any]]) -> ToolCall:
    """Baseline policy: submits without touching anything (must score 0 on every task)."""
    return ToolCall(name="submit", arguments="{}")
