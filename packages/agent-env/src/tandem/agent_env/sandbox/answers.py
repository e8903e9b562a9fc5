"""The supervisor's answers, as the host accepts them: exact types, bounded values.

The supervisor runs in the sandbox, next to the agent's code, so its bytes are never trusted:
every answer is converted to one of these structs before the host looks at a field. One that
does not fit (a wrong type, a missing field, a value out of range) is handled like a
supervisor that died: that episode's sandbox is restarted and the call answered with an
error; nothing raises out of ``Env.step``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

_Code = Annotated[int, msgspec.Meta(ge=-255, le=255)]
_Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 62)]


class Failed(msgspec.Struct, frozen=True):
    """A tool that could not do what was asked; ``error`` is shown to the agent."""

    ok: Literal[False]
    error: str


class Ran(msgspec.Struct, frozen=True):
    """A command's result (``bash``, ``run_tests``)."""

    ok: Literal[True]
    output: str
    exit_code: _Code
    timed_out: bool
    output_limit: bool
    bytes: _Count
    shell_restarted: bool = False
    shell_exited: bool = False
    cwd: str = ""


class Done(msgspec.Struct, frozen=True):
    """A file tool's or ``search``'s result."""

    ok: Literal[True]
    output: str
    exit_code: _Code = 0


class BadAnswer(Exception):
    """An answer that does not fit its schema."""


def check(answer: Any, kind: type[Ran] | type[Done]) -> Ran | Done | Failed:
    """``answer`` (a decoded JSON value) as ``kind`` or `Failed`; raises `BadAnswer`."""
    try:
        if isinstance(answer, dict) and answer.get("ok") is False:
            return msgspec.convert(answer, Failed)
        return msgspec.convert(answer, kind)
    except msgspec.ValidationError as e:
        raise BadAnswer(f"malformed answer from the supervisor: {str(e)[:200]}") from None
