"""What every episode starts from: the system prompt and the task, before the first turn."""

from __future__ import annotations

from typing import Any

from tandem.agent_env.config import EnvConfig
from tandem.agent_env.task import Task

DEFAULT_SYSTEM_PROMPT = (
    "You are a software engineer working in a Python repository. Use the tools to inspect the "
    "code, make the fix, check it with the tests, then call submit. Each call is one turn."
)


def opening_messages(task: Task, config: EnvConfig) -> list[dict[str, Any]]:
    """The messages an episode of ``task`` starts from (what a policy's context holds before
    its first turn): ``config``'s system prompt, or the default one, and the task."""
    return [
        {"role": "system", "content": config.system_prompt or DEFAULT_SYSTEM_PROMPT},
        {"role": "user", "content": task.instruction},
    ]
