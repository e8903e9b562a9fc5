"""Byte-level tokenizer with special tokens for chat roles and tool calls.

Bytes map to ids 0-255 one to one, so any text (code, tool output, non-UTF-8 bytes) has an
exact encoding and nothing needs downloading. Special tokens come after the bytes and are
never produced by encoding text: a tool observation that happens to contain the string
``<|end|>`` stays ordinary bytes and cannot forge a turn boundary.
"""

from __future__ import annotations

from collections.abc import Iterable

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|pad|>",
    "<|bos|>",
    "<|eos|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool|>",
    "<|end|>",
    "<|tool_call|>",
    "<|/tool_call|>",
)
NUM_BYTES = 256


class TokenizerError(ValueError):
    """An id is outside the vocabulary or a special-token name is unknown."""


class ByteTokenizer:
    """Bytes are ids 0-255; `SPECIAL_TOKENS` follow in order."""

    def __init__(self, special_tokens: tuple[str, ...] = SPECIAL_TOKENS) -> None:
        if len(set(special_tokens)) != len(special_tokens):
            raise TokenizerError("special tokens must be unique")
        self.special_tokens = special_tokens
        self._special_ids = {name: NUM_BYTES + i for i, name in enumerate(special_tokens)}

    @property
    def vocab_size(self) -> int:
        return NUM_BYTES + len(self.special_tokens)

    def special(self, name: str) -> int:
        """The id of a special token, e.g. ``special("<|end|>")``."""
        try:
            return self._special_ids[name]
        except KeyError:
            raise TokenizerError(
                f"unknown special token {name!r}; known: {self.special_tokens}"
            ) from None

    def is_special(self, token_id: int) -> bool:
        return NUM_BYTES <= token_id < self.vocab_size

    def encode(self, text: str | bytes) -> list[int]:
        """Encode text as its UTF-8 bytes (bytes are taken as they are)."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return list(data)

    def decode(self, ids: Iterable[int], *, keep_special: bool = True) -> str:
        """Decode ids to text; invalid UTF-8 becomes U+FFFD, special tokens their names."""
        out: list[str] = []
        buf = bytearray()
        for token_id in ids:
            if 0 <= token_id < NUM_BYTES:
                buf.append(token_id)
                continue
            if not self.is_special(token_id):
                raise TokenizerError(
                    f"token id {token_id} is outside the vocabulary (size {self.vocab_size})"
                )
            if buf:
                out.append(buf.decode("utf-8", errors="replace"))
                buf.clear()
            if keep_special:
                out.append(self.special_tokens[token_id - NUM_BYTES])
        if buf:
            out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)
