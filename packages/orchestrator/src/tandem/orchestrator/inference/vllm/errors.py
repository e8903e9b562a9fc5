"""What goes wrong with vLLM before a single episode runs, said plainly."""

from __future__ import annotations


class VllmError(RuntimeError):
    """vLLM could not be set up or started; the message says why and what to change."""


class VllmUnavailable(VllmError):
    """No vLLM environment could be made or found."""


class VllmServerFailed(VllmError):
    """A vLLM server did not start or cannot serve the model (its own reason attached)."""


class VllmRequestRefused(VllmError):
    """A server refused a request as malformed (HTTP 4xx): sending it again would not help."""


class VllmReplyMismatch(VllmError):
    """A server's reply does not fit the policy tandem serves (another model behind the URL)."""
