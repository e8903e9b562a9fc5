"""Scripted policies: the oracle (applies the reference fix through the tools) and a
submit-at-once baseline. Both are ordinary async policies ``messages -> ToolCall``.

The oracle is stateless: it finds its position from the number of tool calls so far, and its
task from the episode (`run_episodes` binds it with ``for_task``) or, called on a bare
conversation, from the instruction, so one instance serves any number of concurrent episodes.
Its transcripts are worked examples for mid-training.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from tandem.agent_env.errors import SandboxError
from tandem.agent_env.task import Task
from tandem.agent_env.tasks.patch import apply_patch, patched_paths, read_repo_file
from tandem.agent_env.tools import ToolCall


def _call(name: str, **args: Any) -> ToolCall:
    return ToolCall(name=name, arguments=json.dumps(args))


def oracle_script(task: Task) -> list[ToolCall]:
    """The tool calls that demonstrate the task's reference fix.

    A fix spread over several files (e.g. the multibug family, whose instruction names no
    file) starts with a run of the visible tests, the baseline an agent takes before a
    multi-file change; a one-file fix (every other task source) goes straight to the file.
    """
    calls: list[ToolCall] = [_call("list_dir", path=".", depth=2)]
    if task.reference_edits:
        paths = dict.fromkeys(e.path for e in task.reference_edits)
        if len(paths) > 1:
            calls.append(_call("run_tests"))
        for path in paths:
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
    """Applies each task's reference fix through the tools, then runs the tests and submits.

    Generated tasks of a narrow family can share an instruction (the same function, bug kind
    and failing example, with another mutation behind it), so the instruction alone cannot
    say which fix to apply: `run_episodes` binds the policy to each episode's task through
    `for_task`. Called on a conversation directly, it looks the instruction up and refuses one
    that several of its tasks share.
    """

    def __init__(self, tasks: Iterable[Task]) -> None:
        self._scripts: dict[str, list[ToolCall]] = {}
        self._tasks: dict[str, list[Task]] = {}
        for t in tasks:
            self._tasks.setdefault(t.instruction, []).append(t)

    def for_task(self, task: Task) -> Callable[[list[dict[str, Any]]], Awaitable[ToolCall]]:
        """This policy for one episode of ``task``."""

        async def policy(messages: list[dict[str, Any]]) -> ToolCall:
            return self._next_call(task, messages)

        return policy

    async def __call__(self, messages: list[dict[str, Any]]) -> ToolCall:
        return self._next_call(self.task_of(messages), messages)

    def task_of(self, messages: list[dict[str, Any]]) -> Task:
        """The task whose instruction opens this conversation (it must be the only one)."""
        instruction = next((m["content"] for m in messages if m.get("role") == "user"), None)
        tasks = self._tasks.get(instruction or "", [])
        if not tasks:
            raise SandboxError("OraclePolicy was not given the task of this conversation")
        if len(tasks) > 1:
            raise SandboxError(
                f"tasks {[t.id for t in tasks]} share this instruction; bind the oracle to the "
                "episode's task with OraclePolicy.for_task (run_episodes does)"
            )
        return tasks[0]

    def _next_call(self, task: Task, messages: list[dict[str, Any]]) -> ToolCall:
        script = self._scripts.get(task.id)
        if script is None:
            script = self._scripts[task.id] = oracle_script(task)
        done = sum(1 for m in messages if m.get("role") == "assistant")
        return script[min(done, len(script) - 1)]


async def submit_at_once(messages: list[dict[str, Any]]) -> ToolCall:
    """Baseline policy: submits without touching anything (must score 0 on every task)."""
    return ToolCall(name="submit", arguments="{}")
