"""What a policy may return, reduced to one assistant turn: optional text plus tool calls.

Accepted, duck-typed (``openai`` is never imported):

- a `ToolCall`;
- one OpenAI tool call, as a dict (``{"id", "type": "function", "function": {"name",
  "arguments"}}``, or flat ``{"name", "arguments"}``) or as an object with
  ``.function.name`` and ``.function.arguments`` (and ``.id``), such as the SDK's
  ``ChatCompletionMessageToolCall``;
- a whole assistant message, as a dict or an object (the SDK's ``ChatCompletionMessage``,
  i.e. ``response.choices[0].message``) with ``tool_calls`` (a list, or None) and optional
  ``content``;
- a list or tuple of tool calls (in any of the forms above): several calls in one turn;
- a plain string: a text-only answer.

A message without tool calls is a text answer too. Anything else is the developer's bug,
not the agent's: `to_turn` raises ``TypeError`` naming what was returned. Within a
recognised shape, what the model wrote (an unknown tool name, arguments that are not JSON)
is the agent's mistake and comes back to it as an observation.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import msgspec

from tandem.agent_env.tools import TOOL_NAMES, ToolCall

TEXT_ANSWER_OBSERVATION = (
    "error: no tool was called. You act on the repository only through the tools ("
    + ", ".join(TOOL_NAMES)
    + "); call submit when the fix is done."
)
"""The observation a text-only answer gets (as a ``user`` message: it answers no call)."""


class Turn(msgspec.Struct, frozen=True):
    """One assistant turn: its text (or None) and its tool calls (none for a text answer)."""

    content: str | None
    calls: tuple[ToolCall, ...]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _error(value: Any, why: str) -> TypeError:
    what = "None" if value is None else f"{type(value).__name__} {_short(value)}"
    return TypeError(
        f"policy returned {what}: {why}. A policy returns a ToolCall, an OpenAI tool call or "
        "assistant message (a dict or an SDK object), a list of tool calls, or a str (a text "
        "answer)"
    )


def _get(obj: Any, key: str) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(key)
    return getattr(obj, key, None)


def _has(obj: Any, key: str) -> bool:
    return key in obj if isinstance(obj, Mapping) else hasattr(obj, key)


def _text(content: Any, reply: Any) -> str | None:
    """A message's content: a string, None, or a list of parts (their text is joined)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list | tuple):
        parts = [_get(p, "text") for p in content]
        if all(isinstance(p, str) for p in parts):
            return "".join(parts)
    raise _error(reply, f"its content is {type(content).__name__}, not a string")


def _call(item: Any, reply: Any, where: str = "it") -> ToolCall:
    if isinstance(item, ToolCall):
        return item
    fn = _get(item, "function") if _has(item, "function") else None
    if fn is None:
        if not (isinstance(item, Mapping) and "name" in item):
            kind = "None" if item is None else type(item).__name__
            raise _error(reply, f"{where} ({kind}) is not a tool call: it has no function")
        fn = item  # a flat {"name", "arguments"} dict
    name = _get(fn, "name")
    arguments = _get(fn, "arguments")
    call_id = _get(item, "id")
    return ToolCall(
        name=name if isinstance(name, str) else repr(name),  # the agent is told it is unknown
        arguments="{}" if arguments is None else arguments,
        id=call_id if isinstance(call_id, str) else "",
        content=_get(item, "content") if isinstance(_get(item, "content"), str) else None,
    )


def _is_message(reply: Any) -> bool:
    if isinstance(reply, Mapping):
        if "function" in reply or "name" in reply:
            return "tool_calls" in reply
        return "tool_calls" in reply or "content" in reply or "role" in reply
    return hasattr(reply, "tool_calls")


def to_turn(reply: Any) -> Turn:
    """Reduce a policy's reply to a `Turn` (raises ``TypeError`` for anything unrecognised)."""
    if isinstance(reply, str):
        return Turn(reply, ())
    if isinstance(reply, ToolCall):
        return Turn(reply.content, (reply,))
    if isinstance(reply, list | tuple):
        calls = tuple(_call(c, reply, f"item {i}") for i, c in enumerate(reply))
        texts = [c.content for c in calls if c.content]
        return Turn("\n".join(texts) if texts else None, calls)
    if _is_message(reply):
        tool_calls = _get(reply, "tool_calls")
        if tool_calls is None:
            tool_calls = []
        if not isinstance(tool_calls, list | tuple):
            raise _error(reply, f"its tool_calls is {type(tool_calls).__name__}, not a list")
        content = _text(_get(reply, "content"), reply)
        calls = tuple(_call(c, reply, f"tool_calls[{i}]") for i, c in enumerate(tool_calls))
        return Turn(content, calls)
    if _has(reply, "choices"):
        raise _error(reply, "that is a whole response; return response.choices[0].message")
    if reply is not None and (_has(reply, "function") or isinstance(reply, Mapping)):
        call = _call(reply, reply)
        return Turn(call.content, (call,))
    raise _error(reply, "not a tool call, a message or a text answer")


def arguments_text(raw: Any) -> str:
    """A call's arguments as the assistant message keeps them (JSON text)."""
    if isinstance(raw, bytes):
        return raw.decode("utf-8", "replace")
    if isinstance(raw, str):
        return raw.encode("utf-8", "replace").decode("utf-8")
    return json.dumps(raw, ensure_ascii=False, default=str)


def assistant_message(turn: Turn, call_ids: list[str]) -> dict[str, Any]:
    """The turn as the OpenAI-style ``assistant`` message the conversation keeps: its text,
    and its calls under the ids their ``tool`` answers refer to."""
    if not turn.calls:
        return {"role": "assistant", "content": turn.content or ""}
    return {
        "role": "assistant",
        "content": turn.content,
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": c.name, "arguments": arguments_text(c.arguments)},
            }
            for c, call_id in zip(turn.calls, call_ids, strict=True)
        ],
    }
