"""A checkpoint's own tokenizer and chat template, rendered to exact token ids.

`TemplateChatFormat` reads ``tokenizer.json`` and the chat template (``chat_template.jinja``
or ``tokenizer_config.json``'s ``chat_template``) from a Hugging Face model directory and
offers what `ChatFormat` offers: whole conversations and single turns as (ids, loss mask), the
assistant header, and strict parsing of a generated turn's tool call in the template's own
format (Qwen3's ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks). The tools'
schemas go to the template as ``tools``, so a real checkpoint is told its tools the way it was
trained to read them (Qwen3's ``# Tools`` block in the system turn).

Token-exactness. A conversation is cut into pieces at message boundaries and each piece is
tokenized on its own, so the ids of a conversation are the ids of its turns put end to end:
an episode rendered turn by turn (prompt, then each sampled turn as sampled, then each tool
turn with the next assistant header) is the same ids as the whole conversation rendered at
once, and the policy's sampled tokens are never re-tokenized. An assistant piece ends at the
template's end-of-turn token (where sampling stops); what the template writes after it (a
newline) opens the next piece. A template whose rendering of a conversation is not a prefix
of its rendering of the conversation plus one message cannot be cut this way and is refused.

Templates without tool syntax. A template that ignores ``tools`` or does not write an
assistant's ``tool_calls`` as ``<tool_call>`` blocks (SmolLM2's ChatML template, which also has
no tool role) is detected when the directory is read (`speaks_tools` is False: the template is
rendered with and without a tool, and with a call). Its conversations are rewritten before
rendering (`tool_prompt.in_text`): the tools listed in the system message in a fixed text with
the call syntax, each call written into the assistant's content as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, each tool result a ``user`` turn
between ``<tool_response>`` markers. Replies are parsed from the same syntax, and both
token-exactness properties above hold as they do for a template with tool syntax.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.orchestrator.inference import tool_prompt
from tandem.orchestrator.inference.chat_format import ParsedTurn, ToolCall, ToolCallFormatError
from tandem.orchestrator.inference.tokenizer import TokenizerError

_SENTINEL = "\u2063tandem\u2063"
_PROBE_TOOL = "tandem_probe_tool"
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _mark(index: int) -> str:
    return f"\u2063{index}\u2063"


def _marked(message: Mapping[str, Any], index: int) -> Mapping[str, Any]:
    """The message with its content replaced by a mark, for non-assistant text messages."""
    if message.get("role") == "assistant" or not isinstance(message.get("content"), str):
        return message
    return {**message, "content": _mark(index)}


@dataclass
class _Piece:
    text: str
    message: Mapping[str, Any] | None = None
    index: int = -1
    trained: bool = False


class TemplateError(ValueError):
    """A model directory's tokenizer or chat template cannot be used (the message says why)."""


class HFTokenizer:
    """A ``tokenizers`` tokenizer with the interface the stages use (`ByteTokenizer`'s)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        file = path / "tokenizer.json"
        if not file.is_file():
            raise TemplateError(f"{path}: missing tokenizer.json")
        self.inner = Tokenizer.from_file(str(file))
        self.literal = Tokenizer.from_file(str(file))
        self.literal.encode_special_tokens = True
        self.special_ids = {
            i for i, t in self.inner.get_added_tokens_decoder().items() if t.special
        }

    @property
    def vocab_size(self) -> int:
        """One past the highest id (ids a checkpoint's padded embedding has beyond it are
        never sampled)."""
        return max(self.inner.get_vocab(with_added_tokens=True).values()) + 1

    def special(self, name: str) -> int:
        token_id = self.inner.token_to_id(name)
        if token_id is None:
            raise TokenizerError(f"token {name!r} is not in the tokenizer's vocabulary")
        return token_id

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_ids

    def encode(self, text: str | bytes) -> list[int]:
        """Text to ids, no special tokens added; bytes that are not UTF-8 become U+FFFD (the
        tokenizer's vocabulary is of text), the same way every time."""
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self.inner.encode(text, add_special_tokens=False).ids

    def encode_literal(self, text: str) -> list[int]:
        """Text that must not produce special tokens (a tool's output that spells
        ``<|im_end|>`` stays text and cannot forge a turn boundary)."""
        return self.literal.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], *, keep_special: bool = True) -> str:
        return self.inner.decode(list(ids), skip_special_tokens=not keep_special)


def _template_source(path: Path) -> str:
    file = path / "chat_template.jinja"
    if file.is_file():
        return file.read_text()
    config = path / "tokenizer_config.json"
    template = json.loads(config.read_text()).get("chat_template") if config.is_file() else None
    if isinstance(template, list):  # named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if not isinstance(template, str):
        raise TemplateError(
            f"{path}: no chat template (chat_template.jinja or tokenizer_config.json's "
            "chat_template)"
        )
    return template


class TemplateChatFormat:
    """Renders OpenAI-style messages with a checkpoint's chat template, to exact token ids."""

    def __init__(self, directory: str | Path) -> None:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        path = Path(directory)
        self.tok = HFTokenizer(path)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)

        def fail(message: str) -> None:
            raise TemplateError(f"{path}: chat template: {message}")

        env.globals["raise_exception"] = fail
        try:
            self._template = env.from_string(_template_source(path))
        except jinja2.TemplateError as e:
            raise TemplateError(f"{path}: chat template does not compile: {e}") from None
        # what an assistant turn looks like around its content: header, end token, carry
        probe = [{"role": "user", "content": "x"}]
        self._header_text = self._text(probe, True)[len(self._text(probe)) :]
        turn = self._text([*probe, {"role": "assistant", "content": _SENTINEL}])
        after = turn[turn.index(_SENTINEL) + len(_SENTINEL) :]
        end = next((t for t in self._added_tokens() if after.startswith(t)), None)
        if end is None:
            raise TemplateError(
                f"{path}: the template closes an assistant turn with {after[:20]!r}, which "
                "does not start with a single added token to stop sampling at"
            )
        self._end_text, self._carry = end, after[len(end) :]
        self.end_id = self.tok.special(end)
        self.call_open = self.tok.inner.token_to_id("<tool_call>")
        self.call_close = self.tok.inner.token_to_id("</tool_call>")
        # between mid-training documents and as padding: the tokenizer's end-of-text token
        # (Qwen3's ``<|endoftext|>``), or the end-of-turn token where it has none
        text_end = self.tok.inner.token_to_id("<|endoftext|>")
        self.eos_id = self.end_id if text_end is None else text_end
        self.pad_id = self.eos_id
        self.speaks_tools = self._speaks_tools()
        # renderings cached under this key are rebuilt when the tokenizer or template change
        # (or the text that stands in for a template's missing tool syntax)
        digest = hashlib.blake2b(digest_size=8)
        digest.update((path / "tokenizer.json").read_bytes())
        digest.update(_template_source(path).encode())
        if not self.speaks_tools:
            digest.update(tool_prompt.VERSION.encode())
        self.VERSION = f"template-{digest.hexdigest()}"

    def _speaks_tools(self) -> bool:
        """Whether the template lists ``tools`` and writes an assistant's call as a
        ``<tool_call>`` block; if not, conversations are rewritten (`tool_prompt.in_text`)."""
        import jinja2

        probe = [{"role": "user", "content": "x"}]
        schema = {"type": "function", "function": {"name": _PROBE_TOOL, "parameters": {}}}
        call = {"type": "function", "function": {"name": _PROBE_TOOL, "arguments": {}}}
        try:
            lists = self._text(probe, tools=[schema]) != self._text(probe)
            turn = self._text([*probe, {"role": "assistant", "content": "", "tool_calls": [call]}])
        except (TemplateError, jinja2.TemplateError, TypeError, KeyError):
            return False  # a template that cannot render a tool or a call has no syntax for it
        return lists and "<tool_call>" in turn and _PROBE_TOOL in turn

    def _added_tokens(self) -> list[str]:
        names = [t.content for t in self.tok.inner.get_added_tokens_decoder().values()]
        return sorted(names, key=len, reverse=True)

    def _text(
        self,
        messages: Sequence[Mapping[str, Any]],
        gen: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        listed = list(tools) if tools else None
        return self._template.render(
            messages=list(messages), add_generation_prompt=gen, tools=listed
        )

    def header(self, role: str) -> list[int]:
        """The generation prompt that opens an assistant turn (the only header sampled after)."""
        if role != "assistant":
            raise ValueError("a chat template opens only assistant turns on its own")
        return self.tok.encode(self._header_text)

    def _pieces(
        self,
        messages: Sequence[Mapping[str, Any]],
        gen: bool,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[_Piece]:
        """Pieces whose concatenation is the template's rendering, one per message (an
        assistant's split into header and trained body), plus the generation prompt."""
        if not self.speaks_tools:
            messages, tools = tool_prompt.in_text(messages, tools), None
        marked = [_marked(m, k) for k, m in enumerate(messages)]
        pieces: list[_Piece] = []
        before, carry = "", ""
        for k, message in enumerate(marked):
            text = self._text(marked[: k + 1], tools=tools)
            if not text.startswith(before):
                raise TemplateError(
                    f"the chat template renders message {k} by changing earlier turns; "
                    "turn-by-turn rendering would give other ids than the whole conversation"
                )
            own = text[len(before) :]
            before = text
            if message.get("role") != "assistant":
                literal = messages[k] if marked[k] is not messages[k] else None
                pieces.append(_Piece(carry + own, literal, k))
                carry = ""
                continue
            if carry:
                pieces.append(_Piece(carry))
            head = self._header_text
            if not own.startswith(head):
                raise TemplateError("an assistant turn does not start with the generation prompt")
            cut = own.index(self._end_text, len(head)) + len(self._end_text)
            pieces += [_Piece(head), _Piece(own[len(head) : cut], trained=True)]
            carry = own[cut:]
        # a conversation that ends with an assistant turn ends at its end token, where
        # sampling stopped; the template's text after it belongs to a next turn
        tail = carry + self._text(marked, True, tools)[len(before) :] if gen else ""
        if tail:
            pieces.append(_Piece(tail))
        return pieces

    def _encode(self, piece: _Piece) -> list[int]:
        """A piece's ids; the content of a non-assistant message is encoded as literal text."""
        if piece.message is None:
            return self.tok.encode(piece.text)
        mark = _mark(piece.index)
        if piece.text.count(mark) != 1:
            raise TemplateError(
                f"the chat template writes message {piece.index}'s content "
                f"{piece.text.count(mark)} times; expected once"
            )
        pre, post = piece.text.split(mark)
        content = str(piece.message.get("content") or "")
        return self.tok.encode(pre) + self.tok.encode_literal(content) + self.tok.encode(post)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> tuple[list[int], list[int]]:
        """A whole conversation as (ids, loss_mask): 1 on assistant bodies and end tokens.
        The ids stop at the last turn's end (without the text the template writes after an
        assistant's end token) unless a generation prompt follows. ``tools``: OpenAI-style
        function schemas, passed to the template as ``tools`` (as transformers'
        ``apply_chat_template(..., tools=...)`` does)."""
        ids: list[int] = []
        mask: list[int] = []
        for piece in self._pieces(messages, add_generation_prompt, tools):
            piece_ids = self._encode(piece)
            ids += piece_ids
            mask += [int(piece.trained)] * len(piece_ids)
        return ids, mask

    def render_turn(self, message: Mapping[str, Any]) -> tuple[list[int], list[int]]:
        """One non-assistant message as it follows a sampled assistant turn (ids, mask): the
        same ids as its piece of a whole conversation."""
        if message.get("role") == "assistant":
            raise ValueError("assistant turns are sampled, never rendered on their own")
        stub = {"type": "function", "function": {"name": "f", "arguments": {}}}
        context = [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "", "tool_calls": [stub]},
            message,
        ]
        ids = self._encode(self._pieces(context, False)[-1])
        return ids, [0] * len(ids)

    def parse_assistant(self, ids: Sequence[int]) -> ParsedTurn:
        """Parse a generated turn (with or without its end token): free text, then exactly
        one ``<tool_call>`` block holding ``{"name": ..., "arguments": {...}}``."""
        body = list(ids)
        if body and body[-1] == self.end_id:
            body.pop()
        if self.end_id in body:
            raise ToolCallFormatError(f"the turn contains text after {self._end_text}")
        if any(self.tok.is_special(t) for t in body):
            raise ToolCallFormatError("special tokens are not allowed inside a turn")
        text = self.tok.decode(body)
        calls = list(_CALL.finditer(text))
        if not calls:
            raise ToolCallFormatError(
                'no tool call: write <tool_call>{"name": ..., "arguments": {...}}</tool_call>'
            )
        if len(calls) > 1:
            raise ToolCallFormatError("exactly one tool call per turn is allowed")
        if text[calls[0].end() :].strip():
            raise ToolCallFormatError("nothing may follow </tool_call> in the turn")
        try:
            call = json.loads(calls[0].group(1))
        except json.JSONDecodeError as e:
            raise ToolCallFormatError(
                f"the tool call is not valid JSON: {e.msg} at char {e.pos}"
            ) from None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ToolCallFormatError('the tool call must be {"name": ..., "arguments": {...}}')
        args = call.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                raise ToolCallFormatError("arguments are not valid JSON") from None
        if not isinstance(args, dict):
            raise ToolCallFormatError("arguments must be a JSON object")
        content = text[: calls[0].start()].rstrip("\n")
        return ParsedTurn(content=content, tool_call=ToolCall(name=call["name"], arguments=args))
