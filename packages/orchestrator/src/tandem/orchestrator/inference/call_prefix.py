"""Incremental check that a turn being generated can still become one well-formed tool call.

A small policy that slips one byte inside its tool call usually keeps writing until the token
budget runs out: up to a few hundred tokens that can only end in a format error. Stopping the
turn at the first token after which no continuation can parse (`ChatFormat.parse_assistant`)
and name a known tool with known arguments saves that decoding, and it leaves the mistake as
the turn's last token, so a negative advantage lands on the token that caused the failure
rather than being spread over the junk that followed it.

The check is conservative: it stops only on prefixes that no continuation can repair (JSON
syntax, as ``json.loads`` reads it, plus the tool and argument names); whatever it lets
through is still judged by the parser and the environment.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping
from typing import Any

from tandem.orchestrator.inference.chat_format import ChatFormat
from tandem.orchestrator.inference.template_chat import TemplateChatFormat

_WS = frozenset(b" \t\n\r")
_NUMBER_CHARS = frozenset(b"0123456789+-.eE")
_NUMBER_PREFIX = re.compile(rb"-?(?:0|[1-9][0-9]*)?(?:\.[0-9]*)?(?:[eE][+-]?[0-9]*)?")
_NUMBER = re.compile(rb"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_LITERALS = (b"true", b"false", b"null", b"NaN", b"Infinity", b"-Infinity")


def tool_arguments(schemas: Collection[Mapping[str, Any]]) -> dict[str, frozenset[str]]:
    """Tool name -> its argument names, from OpenAI function-calling schemas."""
    out = {}
    for schema in schemas:
        fn = schema["function"]
        out[fn["name"]] = frozenset((fn.get("parameters") or {}).get("properties") or {})
    return out


class CallPrefix:
    """Feeds on a turn's tokens; `push` returns False once the turn can no longer parse.

    States: ``text`` (free text before the call), ``name`` (the tool's name), ``json`` (the
    argument object and the whitespace around it), ``closed`` (only ``<|end|>`` may follow),
    ``ended``.
    """

    def __init__(self, chat: ChatFormat, tools: Mapping[str, Collection[str]]) -> None:
        self.chat = chat
        self.tools = {name.encode(): {a.encode() for a in args} for name, args in tools.items()}
        self.state = "text"
        self.name = b""
        self.json = _JsonPrefix()
        self.ok = True

    def push(self, token: int) -> bool:
        if self.ok:
            self.ok = self._push(token)
        return self.ok

    def _push(self, token: int) -> bool:
        chat = self.chat
        if self.state == "ended":
            return False  # nothing may follow <|end|>
        if token == chat.end_id:
            self.state = "ended"
            return True  # the turn ends here; the parser gives the verdict
        special = chat.tok.is_special(token)
        if self.state == "text":
            if token == chat.call_open:
                self.state = "name"
                return True
            return not special
        if self.state == "name":
            if token == chat.call_close:  # no arguments: ``{}``
                self.state = "closed"
                return self.name in self.tools
            if special:
                return False
            if token == ord(" "):
                if self.name not in self.tools:
                    return False
                self.json.keys = self.tools[self.name]
                self.state = "json"
                return True
            self.name += bytes([token])
            return any(t.startswith(self.name) for t in self.tools)
        if self.state == "json":
            if token == chat.call_close:
                self.state = "closed"
                return self.json.complete()
            if special:
                return False
            return self.json.push(token)
        return False  # "closed": only <|end|> may follow


def prefix_check(
    chat: ChatFormat | TemplateChatFormat, tools: Mapping[str, Collection[str]]
) -> Callable[[int], bool] | None:
    """A turn's `CallPrefix` check in the byte format (whose ids are bytes, read one by one);
    None for a checkpoint's own format, whose turns only the parser judges."""
    if not isinstance(chat, ChatFormat):
        return None
    return CallPrefix(chat, tools).push


class _JsonPrefix:
    """A byte-level pushdown automaton for prefixes of one JSON object (``json.loads`` rules).

    Whitespace may surround the object. At the top level only ``keys`` are accepted as keys
    (None: any key).
    """

    def __init__(self) -> None:
        self.keys: Collection[bytes] | None = None
        self.stack: list[int] = []  # b"{" or b"[" of the open containers
        self.mode = "start"
        self.buf = b""  # the current top-level key, number or literal
        self.is_key = False
        self.check_key = True  # False once a key holds an escape (its text is not tracked)
        self.hex_left = 0

    def complete(self) -> bool:
        """Whether the bytes so far (and nothing more) are an empty or whole JSON object."""
        return self.mode in ("start", "done")

    def push(self, b: int) -> bool:
        mode = self.mode
        if mode == "string":
            return self._string(b)
        if mode == "escape":
            if b == ord("u"):
                self.mode, self.hex_left = "unicode", 4
                return True
            self.mode = "string"
            return b in b'"\\/bfnrt'
        if mode == "unicode":
            self.hex_left -= 1
            if self.hex_left == 0:
                self.mode = "string"
            return b in b"0123456789abcdefABCDEF"
        if mode == "number":
            if b in _NUMBER_CHARS:
                self.buf += bytes([b])
                return _NUMBER_PREFIX.fullmatch(self.buf) is not None
            if self.buf == b"-" and b == ord("I"):
                self.mode, self.buf = "literal", b"-I"
                return True
            if _NUMBER.fullmatch(self.buf) is None:
                return False
            self.mode = "after_value"
            return self.push(b)
        if mode == "literal":
            self.buf += bytes([b])
            if not any(lit.startswith(self.buf) for lit in _LITERALS):
                return False
            if self.buf in _LITERALS and not any(
                lit != self.buf and lit.startswith(self.buf) for lit in _LITERALS
            ):
                self.mode = "after_value"
            return True
        if b in _WS:
            return True
        if mode == "start":
            if b != ord("{"):
                return False
            self.stack.append(b)
            self.mode = "key_or_close"
            return True
        if mode == "done":
            return False
        if mode in ("key_or_close", "key"):
            if b == ord("}") and mode == "key_or_close":
                return self._close(b)
            if b != ord('"'):
                return False
            self.mode, self.is_key, self.check_key, self.buf = "string", True, True, b""
            return True
        if mode == "colon":
            if b != ord(":"):
                return False
            self.mode = "value"
            return True
        if mode in ("value", "value_or_close"):
            if b == ord("]") and mode == "value_or_close":
                return self._close(b)
            return self._value(b)
        if mode == "after_value":
            if b == ord(","):
                self.mode = "key" if self.stack[-1] == ord("{") else "value"
                return True
            if b in b"]}":
                return self._close(b)
            return False
        raise AssertionError(f"unknown mode {mode}")

    def _string(self, b: int) -> bool:
        if b == ord('"'):
            if not self.is_key:
                self.mode = "after_value"
                return True
            self.mode = "colon"
            return self._key_ok(whole=True)
        if b == ord("\\"):
            self.mode = "escape"
            self.check_key = False
            return True
        if b < 0x20:
            return False  # control characters are not allowed inside JSON strings
        if self.is_key:
            self.buf += bytes([b])
            return self._key_ok(whole=False)
        return True

    def _key_ok(self, *, whole: bool) -> bool:
        if self.keys is None or len(self.stack) != 1 or not self.check_key:
            return True
        if whole:
            return self.buf in self.keys
        return any(k.startswith(self.buf) for k in self.keys)

    def _value(self, b: int) -> bool:
        if b == ord('"'):
            self.mode, self.is_key = "string", False
            return True
        if b in b"{[":
            self.stack.append(b)
            self.mode = "key_or_close" if b == ord("{") else "value_or_close"
            return True
        if b in _NUMBER_CHARS and b not in b"+.eE":
            self.mode, self.buf = "number", bytes([b])
            return True
        if b in b"tfnNI":
            self.mode, self.buf = "literal", bytes([b])
            return any(lit.startswith(self.buf) for lit in _LITERALS)
        return False

    def _close(self, b: int) -> bool:
        opener = self.stack.pop()
        if (opener, b) not in ((ord("{"), ord("}")), (ord("["), ord("]"))):
            return False
        self.mode = "after_value" if self.stack else "done"
        return True
