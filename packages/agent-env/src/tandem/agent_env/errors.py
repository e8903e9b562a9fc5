"""The package's single exception type."""

from __future__ import annotations


class SandboxError(RuntimeError):
    """Raised when the environment cannot do what was asked (bad task, no sandbox, bad config).

    Messages say what was wrong and what to do about it. Agent mistakes (a bad tool call, a
    failing command) never raise: they come back as observations.
    """
