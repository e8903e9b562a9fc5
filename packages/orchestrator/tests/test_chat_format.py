"""Byte tokenizer and chat/tool-call format: exact round trips and strict parsing."""

from __future__ import annotations

import json

import pytest

from tandem.orchestrator.inference.chat_format import ChatFormat, ToolCall, ToolCallFormatError
from tandem.orchestrator.inference.tokenizer import (
    NUM_BYTES,
    SPECIAL_TOKENS,
    ByteTokenizer,
    TokenizerError,
)

TOK = ByteTokenizer()
FMT = ChatFormat(TOK)


def test_bytes_round_trip_and_specials_never_come_from_text() -> None:
    text = "def f(x):\n    return x <|end|> ünïcødé\t"
    ids = TOK.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(i < NUM_BYTES for i in ids)
    assert TOK.decode(ids) == text
    assert TOK.vocab_size == NUM_BYTES + len(SPECIAL_TOKENS)


def test_decode_rejects_out_of_vocab_and_replaces_bad_utf8() -> None:
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        TOK.decode([TOK.vocab_size])
    assert TOK.decode([0xFF, 0x41]) == "\ufffdA"
    with pytest.raises(TokenizerError, match="unknown special token"):
        TOK.special("<|nope|>")


def _messages() -> list[dict]:
    call = ToolCall(name="edit", arguments={"path": "a.py", "old": "x - 1", "new": "x + 1"})
    return [
        {"role": "system", "content": "You fix bugs."},
        {"role": "user", "content": "Fix add()."},
        {"role": "assistant", "content": "Editing.", "tool_calls": [call.to_openai("c0")]},
        {"role": "tool", "content": "ok", "tool_call_id": "c0"},
    ]


def test_render_masks_only_assistant_bodies() -> None:
    ids, mask = FMT.render(_messages(), add_generation_prompt=True)
    assert len(ids) == len(mask)
    trained = TOK.decode([t for t, m in zip(ids, mask, strict=True) if m])
    # Arguments in the order given (path, old, new), compact separators.
    expected_call = '<|tool_call|>edit {"path":"a.py","old":"x - 1","new":"x + 1"}<|/tool_call|>'
    assert trained == "Editing." + expected_call + "<|end|>"
    assert ids[-1] == TOK.special("<|assistant|>") and mask[-1] == 0
    text = TOK.decode(ids)
    assert text.startswith("<|system|>You fix bugs.<|end|><|user|>Fix add().<|end|><|assistant|>")
    assert "<|tool|>ok<|end|>" in text


def test_parse_is_the_inverse_of_render() -> None:
    call = ToolCall(name="bash", arguments={"command": "ls -la", "n": [1, 2]})
    body = TOK.encode("let me look") + FMT.render_tool_call(call) + [FMT.end_id]
    parsed = FMT.parse_assistant(body)
    assert parsed.content == "let me look"
    assert parsed.tool_call == call
    assert json.loads(call.to_openai("x")["function"]["arguments"]) == call.arguments


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ("just text", "no tool call"),
        ("<|tool_call|>bash {}", "not closed"),
        ("<|tool_call|>bash {}<|/tool_call|><|tool_call|>x {}<|/tool_call|>", "exactly one"),
        ("<|tool_call|>bash {}<|/tool_call|> trailing", "nothing may follow"),
        ("<|tool_call|>bash {not json}<|/tool_call|>", "not valid JSON"),
        ("<|tool_call|>bash [1]<|/tool_call|>", "JSON object"),
        ("<|tool_call|>9bad {}<|/tool_call|>", "valid identifier"),
        ("<|user|><|tool_call|>bash {}<|/tool_call|>", "role tokens"),
    ],
)
def test_malformed_turns_raise_with_reason(body: str, reason: str) -> None:
    ids: list[int] = []
    for piece in body.replace("<|", "\0<|").replace("|>", "|>\0").split("\0"):
        ids += [TOK.special(piece)] if piece in SPECIAL_TOKENS else TOK.encode(piece)
    with pytest.raises(ToolCallFormatError, match=reason):
        FMT.parse_assistant(ids)


def test_invalid_utf8_in_call_is_a_format_error() -> None:
    ids = [FMT.call_open, *TOK.encode("bash "), 0xFF, FMT.call_close]
    with pytest.raises(ToolCallFormatError, match="UTF-8"):
        FMT.parse_assistant(ids)
