"""The package's exception types."""

from __future__ import annotations

from pathlib import Path


class SandboxError(RuntimeError):
    """Raised when the environment cannot do what was asked (bad task, no sandbox, bad config).
    A malformed task file raises `TaskFileError` instead.

    Messages say what was wrong and what to do about it. Agent mistakes (a bad tool call, a
    failing command) never raise: they come back as observations.
    """


class TaskFileError(ValueError):
    """A task file or record that is not what the loader expects (a data error).

    ``path`` and ``line`` say where (None for a record that did not come from a file); the
    message starts with ``path:line:`` and says what is wrong with that line.
    """

    def __init__(
        self, where: str, problem: str, path: Path | None = None, line: int | None = None
    ) -> None:
        super().__init__(f"{where}: {problem}")
        self.where = where
        self.problem = problem
        self.path = path
        self.line = line


class PolicyError(RuntimeError):
    """A policy could not produce a reply: its endpoint failed, timed out or answered with
    something that is not a chat completion. `run_episodes` marks the episode as a
    ``policy_error`` infrastructure fault (reward None) with this message."""
