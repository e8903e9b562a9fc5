"""Which chat format a policy speaks: its checkpoint's own, or the built-in byte format.

A policy whose directory (``model.path``, or a stage's output that kept the checkpoint's
tokenizer files) holds a ``tokenizer.json`` is rendered with that tokenizer and its chat
template (`TemplateChatFormat`); any other policy, the demo's among them, with the byte
tokenizer and `ChatFormat`. Every stage asks `chat_format_for` with the policy's path, so
mid-training transcripts, rollouts and evaluations of one policy share one format, and a
rollout actor rebuilds the same format from the same path in its own process.
"""

from __future__ import annotations

from pathlib import Path

from tandem.orchestrator.config import ConfigValueError
from tandem.orchestrator.inference.chat_format import ChatFormat
from tandem.orchestrator.inference.template_chat import TemplateChatFormat, TemplateError

AnyChatFormat = ChatFormat | TemplateChatFormat


def has_own_tokenizer(path: str | Path | None) -> bool:
    """Whether the model directory at ``path`` brings its own tokenizer (``tokenizer.json``)."""
    return bool(path) and (Path(str(path)) / "tokenizer.json").is_file()


def chat_format_for(path: str | Path | None) -> AnyChatFormat:
    """The chat format of the policy at ``path`` (a model directory, or empty: the byte
    format of a freshly built policy). A tokenizer or template that cannot be used is a
    `ConfigValueError` naming ``model.path``."""
    if not has_own_tokenizer(path):
        return ChatFormat()
    try:
        return TemplateChatFormat(str(path))
    except TemplateError as e:
        raise ConfigValueError(f"model.path: {e}") from None
