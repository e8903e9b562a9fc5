"""The policy's chat and tool-call format, rendered to and parsed from exact token ids.

A conversation is a sequence of turns ``<|role|> content <|end|>``. An assistant turn may
carry one tool call, written as ``<|tool_call|>NAME {json arguments}<|/tool_call|>`` before its
``<|end|>``. Rendering returns the loss mask too (1 on the tokens the policy generates: an
assistant turn's body and its closing ``<|end|>``), so mid-training transcripts and RL
trajectories are scored on exactly the tokens the model is responsible for.

Parsing is strict: anything the policy writes that is not one well-formed tool call raises
`ToolCallFormatError` with a reason the environment can show the agent as an observation.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from tandem.orchestrator.inference.tokenizer import ByteTokenizer

ROLES = ("system", "user", "assistant", "tool")


class ToolCallFormatError(ValueError):
    """The policy's output is not exactly one well-formed tool call."""


class ToolCall(msgspec.Struct, frozen=True):
    """A parsed call: the tool's name and its JSON-object arguments."""

    name: str
    arguments: dict[str, Any]

    def to_openai(self, call_id: str) -> dict[str, Any]:
        """The OpenAI function-calling shape used in trajectories' messages."""
        return {
            "id": call_id,
            "type": "function",
            "function": {
                "name": self.name,
                "arguments": json.dumps(self.arguments, ensure_ascii=False),
            },
        }


class ParsedTurn(msgspec.Struct, frozen=True):
    """An assistant turn split into free text (reasoning) and its tool call."""

    content: str
    tool_call: ToolCall


class ChatFormat:
    """Renders OpenAI-style messages to token ids and parses generated assistant turns."""

    VERSION = 2
    """Bumped whenever rendering changes, so cached renderings are rebuilt."""

    def __init__(self, tokenizer: ByteTokenizer | None = None) -> None:
        self.tok = tokenizer or ByteTokenizer()
        self.end_id = self.tok.special("<|end|>")
        self.call_open = self.tok.special("<|tool_call|>")
        self.call_close = self.tok.special("<|/tool_call|>")
        self.role_ids = {role: self.tok.special(f"<|{role}|>") for role in ROLES}
        self.eos_id = self.tok.special("<|eos|>")  # between mid-training documents
        self.pad_id = self.tok.special("<|pad|>")

    def header(self, role: str) -> list[int]:
        """The token that opens a turn of ``role`` (the generation prompt for "assistant")."""
        if role not in self.role_ids:
            raise ValueError(f"unknown role {role!r}; expected one of {ROLES}")
        return [self.role_ids[role]]

    def render_tool_call(self, call: ToolCall) -> list[int]:
        # Arguments keep the caller's order (the tool schema's: path, old_string, new_string),
        # so the policy copies the line it replaces before it writes the replacement.
        args = json.dumps(call.arguments, ensure_ascii=False, separators=(",", ":"))
        return [self.call_open, *self.tok.encode(f"{call.name} {args}"), self.call_close]

    def render_turn(self, message: Mapping[str, Any]) -> tuple[list[int], list[int]]:
        """One message as (ids, loss_mask); only assistant bodies are trained on."""
        role = message.get("role")
        ids = self.header(str(role))
        body = self.tok.encode(message.get("content") or "")
        if role == "assistant":
            for raw in message.get("tool_calls") or []:
                fn = raw["function"]
                args = fn["arguments"]
                args = json.loads(args) if isinstance(args, str) else dict(args)
                body += self.render_tool_call(ToolCall(name=fn["name"], arguments=args))
        body.append(self.end_id)
        trained = 1 if role == "assistant" else 0
        return ids + body, [0] * len(ids) + [trained] * len(body)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> tuple[list[int], list[int]]:
        """A whole conversation as (ids, loss_mask), optionally opening an assistant turn.

        ``tools`` is accepted for the interface a checkpoint's template has, and not written:
        the byte format has no tool listing (its tiny policies learn their tools, name and
        arguments, from the oracle's transcripts, and every token of a listing would come out
        of their short context)."""
        del tools
        ids: list[int] = []
        mask: list[int] = []
        for message in messages:
            t_ids, t_mask = self.render_turn(message)
            ids += t_ids
            mask += t_mask
        if add_generation_prompt:
            ids += self.header("assistant")
            mask += [0]
        return ids, mask

    def parse_assistant(self, ids: Sequence[int]) -> ParsedTurn:
        """Parse a generated assistant turn (its body, with or without the closing ``<|end|>``)."""
        body = list(ids)
        if body and body[-1] == self.end_id:
            body.pop()
        if self.end_id in body:
            raise ToolCallFormatError("the turn contains text after <|end|>")
        opens = [i for i, t in enumerate(body) if t == self.call_open]
        closes = [i for i, t in enumerate(body) if t == self.call_close]
        if not opens:
            raise ToolCallFormatError(
                "no tool call: write <|tool_call|>NAME {json arguments}<|/tool_call|>"
            )
        if len(opens) > 1 or len(closes) > 1:
            raise ToolCallFormatError("exactly one tool call per turn is allowed")
        if not closes or closes[0] < opens[0]:
            raise ToolCallFormatError("the tool call is not closed with <|/tool_call|>")
        if closes[0] != len(body) - 1:
            raise ToolCallFormatError("nothing may follow <|/tool_call|> in the turn")
        stray = [
            t for t in body if self.tok.is_special(t) and t not in (self.call_open, self.call_close)
        ]
        if stray:
            raise ToolCallFormatError("role tokens are not allowed inside a turn")
        content = self.tok.decode(body[: opens[0]], keep_special=False)
        try:
            call_text = bytes(body[opens[0] + 1 : closes[0]]).decode("utf-8")
        except UnicodeDecodeError:
            raise ToolCallFormatError("the tool call is not valid UTF-8") from None
        name, _, raw_args = call_text.partition(" ")
        if not name.isidentifier():
            raise ToolCallFormatError(f"tool name {name[:40]!r} is not a valid identifier")
        try:
            args = json.loads(raw_args) if raw_args.strip() else {}
        except json.JSONDecodeError as e:
            raise ToolCallFormatError(
                f"arguments are not valid JSON: {e.msg} at char {e.pos}"
            ) from None
        if not isinstance(args, dict):
            raise ToolCallFormatError("arguments must be a JSON object")
        return ParsedTurn(content=content, tool_call=ToolCall(name=name, arguments=args))
