"""The agent's tools: OpenAI function-calling schemas and strict argument validation.

Validation happens on the host before anything reaches the sandbox, so a malformed call
(unknown tool, invalid JSON, a missing or wrongly typed argument, text that is not valid
UTF-8) costs a turn and returns a precise error instead of a traceback.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec


class ToolCall(msgspec.Struct, frozen=True):
    """What a policy returns: one function call, plus optional assistant text and metadata.

    ``arguments`` is the JSON text the model produced (or an already parsed dict).
    ``metadata`` is stored with the step untouched (token ids, log-probs, policy version).
    """

    name: str
    arguments: str | bytes | dict[str, Any] = "{}"
    id: str = ""
    content: str | None = None
    metadata: dict[str, Any] = {}


_STR = {"type": "string"}
_INT = {"type": "integer"}


def _fn(name: str, description: str, props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": props,
                "required": required,
                "additionalProperties": False,
            },
        },
    }


TOOL_SCHEMAS: list[dict[str, Any]] = [
    _fn(
        "bash",
        "Run a command in a persistent bash session that starts in the repository root: the "
        "working directory, variables and functions carry over between calls, background "
        "processes end with the call. No network. Output is truncated in the middle when long.",
        {"command": {**_STR, "description": "the command line"}},
        ["command"],
    ),
    _fn(
        "read_file",
        "Show a text file with line numbers, optionally only lines start_line..end_line.",
        {
            "path": {**_STR, "description": "path relative to the repository root"},
            "start_line": {**_INT, "description": "first line (1-based)"},
            "end_line": {**_INT, "description": "last line (inclusive)"},
        },
        ["path"],
    ),
    _fn(
        "search",
        "Search files for a regular expression (grep -E); prints path:line: text.",
        {
            "pattern": {**_STR, "description": "extended regular expression"},
            "path": {
                **_STR,
                "description": "file or directory to search (default: the repository)",
            },
            "glob": {**_STR, "description": "only files whose name matches, e.g. *.py"},
        },
        ["pattern"],
    ),
    _fn(
        "list_dir",
        "List a directory (directories end with /).",
        {
            "path": {**_STR, "description": "directory (default: the repository root)"},
            "depth": {**_INT, "description": "levels to descend, 1-5 (default 1)"},
        },
        [],
    ),
    _fn(
        "edit",
        "Replace old_string with new_string in a file; old_string must match exactly once.",
        {"path": _STR, "old_string": _STR, "new_string": _STR},
        ["path", "old_string", "new_string"],
    ),
    _fn(
        "write_file",
        "Create or overwrite a file with the given content.",
        {"path": _STR, "content": _STR},
        ["path", "content"],
    ),
    _fn("run_tests", "Run the repository's visible tests.", {}, []),
    _fn("submit", "Submit the current state of the repository as the final answer.", {}, []),
]

_BY_NAME = {s["function"]["name"]: s["function"]["parameters"] for s in TOOL_SCHEMAS}
TOOL_NAMES = tuple(_BY_NAME)
READ_ONLY_TOOLS = frozenset({"read_file", "search", "list_dir", "run_tests"})
"""The tools that change nothing in the workspace (the tests run without writing bytecode):
an episode without its calls to them gives every other observation unchanged."""


def tool_schemas() -> list[dict[str, Any]]:
    """The tools in OpenAI function-calling format (a fresh copy, safe to modify)."""
    return json.loads(json.dumps(TOOL_SCHEMAS))


class ToolCallError(ValueError):
    """A malformed tool call; its message is shown to the agent."""


MAX_ARGUMENTS_CHARS = 8 << 20
"""Longest arguments text accepted (a large ``write_file`` fits; megabytes more do not)."""
MAX_PATH_CHARS = 4096
"""Longest ``path`` (Linux's PATH_MAX)."""
_INT_RANGE = (-(1 << 31), (1 << 31) - 1)


def _quote(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters: error messages never echo an argument
    whole, so a malformed call cannot flood the observation."""
    text = repr(value) if not isinstance(value, str) or len(value) <= limit else repr(value[:limit])
    return text if len(text) <= limit else text[: limit - 3] + "..."


OBSERVATION_SLACK = 2000
"""Characters an observation may exceed the head and tail caps by: room for the notes after a
command's output (exit code, limits hit), which was cut to head and tail in the sandbox."""


def cap_observation(text: str, head: int, tail: int) -> str:
    """The head and tail of ``text`` with a marker for what was cut: every observation goes
    through this (bash output is already cut this way inside the sandbox, and passes)."""
    if len(text) <= head + tail + OBSERVATION_SLACK:
        return text
    omitted = len(text) - head - tail
    return (
        text[:head] + f"\n[... {omitted} characters omitted ...]\n" + (text[-tail:] if tail else "")
    )


_UNITTEST_DURATION = re.compile(r"^(Ran \d+ tests?) in \d+(?:\.\d+)?s$", re.M)
_PYTEST_OUTCOME = (
    r"\d+ (?:passed|failed|errors?|skipped|xfailed|xpassed|warnings?|deselected|rerun)"
)
_PYTEST_DURATION = re.compile(
    rf"({_PYTEST_OUTCOME}(?:, {_PYTEST_OUTCOME})*|no tests ran) in \d+(?:\.\d+)?s"
    r"(?: \(\d+:\d\d:\d\d\))?"
)


def without_durations(text: str) -> str:
    """A test run's output without the wall-clock time its runner reports ("Ran 14 tests
    in 0.005s", "3 passed in 0.12s"): an observation must not depend on how busy the
    machine was, or the same calls give other tokens (a mid-training transcript and the
    rollout that replays it, two runs of one seed)."""
    return _PYTEST_DURATION.sub(r"\1", _UNITTEST_DURATION.sub(r"\1", text))


def _check_text(value: str, where: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ToolCallError(
            f"{where} is not valid UTF-8 text ({e.reason} at position {e.start})"
        ) from None


def parse_call(name: Any, arguments: Any) -> dict[str, Any]:
    """Validate a call against its schema and return the arguments as a dict. Anything
    malformed (however deep, large or oddly typed) raises `ToolCallError` with a short
    message; nothing else escapes."""
    try:
        return _parse_call(name, arguments)
    except ToolCallError:
        raise
    except (ValueError, TypeError, RecursionError, MemoryError, OverflowError) as e:
        raise ToolCallError(
            f"arguments of {_quote(name)} could not be read: {type(e).__name__}"
        ) from None


def _parse_call(name: Any, arguments: Any) -> dict[str, Any]:
    if not isinstance(name, str) or name not in _BY_NAME:
        raise ToolCallError(
            f"unknown tool {_quote(name)}; available tools: {', '.join(TOOL_NAMES)}"
        )
    if isinstance(arguments, bytes | str) and len(arguments) > MAX_ARGUMENTS_CHARS:
        raise ToolCallError(
            f"arguments of {name} are {len(arguments)} characters long, over the limit of "
            f"{MAX_ARGUMENTS_CHARS}"
        )
    if isinstance(arguments, bytes):
        try:
            arguments = arguments.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ToolCallError(
                f"arguments of {name} are not valid UTF-8 (byte {e.start})"
            ) from None
    if isinstance(arguments, str):
        _check_text(arguments, f"arguments of {name}")
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise ToolCallError(f"arguments of {name} are not valid JSON: {e}") from None
        except RecursionError:
            raise ToolCallError(f"arguments of {name} are nested too deeply") from None
        except ValueError as e:  # e.g. an integer of thousands of digits
            raise ToolCallError(f"arguments of {name} are not valid JSON: {str(e)[:120]}") from None
    if not isinstance(arguments, dict):
        raise ToolCallError(
            f"arguments of {name} must be a JSON object, got {type(arguments).__name__}"
        )
    schema = _BY_NAME[name]
    props: dict[str, Any] = schema["properties"]
    for key in schema["required"]:
        if key not in arguments:
            raise ToolCallError(f"{name} is missing the required argument {key!r}")
    for key, value in arguments.items():
        if key not in props:
            raise ToolCallError(
                f"{name} has no argument {_quote(key)}; it takes: {', '.join(props) or 'none'}"
            )
        want = props[key]["type"]
        if want == "string":
            if not isinstance(value, str):
                raise ToolCallError(f"{name}.{key} must be a string, got {type(value).__name__}")
            _check_text(value, f"{name}.{key}")
            if "\0" in value and key != "content" and key != "new_string":
                raise ToolCallError(f"{name}.{key} contains a NUL character")
            if key == "path" and len(value) > MAX_PATH_CHARS:
                raise ToolCallError(
                    f"{name}.path is {len(value)} characters long; at most {MAX_PATH_CHARS}"
                )
        elif want == "integer":
            if not isinstance(value, int) or isinstance(value, bool):
                raise ToolCallError(f"{name}.{key} must be an integer, got {type(value).__name__}")
            if not _INT_RANGE[0] <= value <= _INT_RANGE[1]:
                raise ToolCallError(
                    f"{name}.{key} must be between {_INT_RANGE[0]} and {_INT_RANGE[1]}"
                )
    return arguments
