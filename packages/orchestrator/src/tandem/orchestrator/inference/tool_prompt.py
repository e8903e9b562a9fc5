"""Tool calls for a chat template that has no tool syntax (SmolLM2's ChatML, for one).

Such a template ignores ``tools``, drops an assistant message's ``tool_calls`` and has no tool
role, so a policy rendered with it is never told its tools, its calls vanish from the
conversations it is trained on, and its tool results arrive under a role it never saw.
`TemplateChatFormat` then rewrites each conversation into messages the template does render,
in this fixed text:

* The tools are listed at the end of the system message (one is added where the conversation
  has none), after `TOOLS_HEADER`: one line per tool, ``{"name": ..., "description": ...,
  "parameters": {JSON schema}}``, then `CALL_INSTRUCTIONS`.
* An assistant's call is written into its content, after its text and a newline, as
  ``<tool_call>{"name": "NAME", "arguments": {...}}</tool_call>`` (compact JSON on one line),
  the form `TemplateChatFormat.parse_assistant` reads back.
* A tool result is a ``user`` message whose content is the result between
  ``<tool_response>\\n`` and ``\\n</tool_response>`` (the markers Qwen3 and Hermes use).

The rewrite works message by message (the system message's only change is the appended
listing), so a conversation's rendering stays a prefix of its rendering with one more message
and turn-by-turn rendering keeps giving the whole conversation's ids.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

TOOLS_HEADER = (
    "# Tools\n\nYou can call these tools (each line: the tool's name, what it does and the "
    "JSON schema of its arguments):\n"
)
CALL_INSTRUCTIONS = (
    "\nTo call a tool, end your reply with exactly one call, written as\n"
    '<tool_call>{"name": "TOOL_NAME", "arguments": {ARGUMENTS AS A JSON OBJECT}}</tool_call>\n'
    "The tool's result comes back in the next user message, between <tool_response> and "
    "</tool_response>."
)
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>\n", "\n</tool_response>"
VERSION = "tools-in-text-1"
"""Changes whenever the text above does (cached renderings key on it)."""


def describe_tools(tools: Sequence[Mapping[str, Any]]) -> str:
    """The tool listing appended to the system message (OpenAI function schemas in)."""
    lines = []
    for tool in tools:
        fn = tool.get("function", tool)
        entry = {"name": fn["name"], "description": fn.get("description", "")}
        entry["parameters"] = fn.get("parameters") or {"type": "object", "properties": {}}
        lines.append(json.dumps(entry, ensure_ascii=False))
    return TOOLS_HEADER + "\n".join(lines) + "\n" + CALL_INSTRUCTIONS


def call_text(call: Mapping[str, Any]) -> str:
    """One OpenAI-style tool call as the text an assistant writes for it."""
    fn = call.get("function", call)
    args = fn.get("arguments") or {}
    if isinstance(args, str):
        args = json.loads(args) if args.strip() else {}
    body = json.dumps({"name": fn["name"], "arguments": args}, ensure_ascii=False)
    return f"<tool_call>{body}</tool_call>"


def _assistant(message: Mapping[str, Any]) -> dict[str, Any]:
    calls = [call_text(c) for c in message.get("tool_calls") or []]
    text = str(message.get("content") or "")
    content = "\n".join([text, *calls] if text else calls)
    return {"role": "assistant", "content": content}


def in_text(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
) -> list[Mapping[str, Any]]:
    """``messages`` rewritten for a template without tool syntax: the listing in the system
    message (where there are tools), calls in assistant content, results as user turns."""
    out: list[Mapping[str, Any]] = []
    for message in messages:
        role = message.get("role")
        if role == "assistant":
            out.append(_assistant(message))
        elif role == "tool":
            content = f"{RESPONSE_OPEN}{message.get('content') or ''}{RESPONSE_CLOSE}"
            out.append({"role": "user", "content": content})
        else:
            out.append(message)
    if tools:
        listing = describe_tools(tools)
        if out and out[0].get("role") == "system":
            own = str(out[0].get("content") or "")
            out[0] = {**out[0], "content": f"{own}\n\n{listing}" if own else listing}
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out
