"""`OpenAIPolicy`: any OpenAI-compatible chat-completions endpoint as a policy.

Standard library only: each request is a ``urllib`` POST in a worker thread of the policy's
own pool (``max_concurrency`` threads, so that many episodes wait on the endpoint at once;
asyncio's default pool has only a few). Proxies come from the usual environment variables,
as with every ``urllib`` client.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tandem.agent_env.errors import PolicyError
from tandem.agent_env.tools import tool_schemas


def _snippet(payload: bytes, limit: int = 300) -> str:
    text = payload.decode("utf-8", "replace").strip()
    return text if len(text) <= limit else text[:limit] + "..."


class OpenAIPolicy:
    """A policy that asks ``POST {base_url}/chat/completions`` for each turn.

    It sends the conversation and the environment's tools (`tool_schemas()`) and returns
    the endpoint's ``choices[0].message`` (a dict) as it is: tool calls (one or several) or
    a text answer, both of which `Env.step` takes. ``base_url`` is what the OpenAI SDK calls
    it, e.g. ``https://api.openai.com/v1`` or ``http://127.0.0.1:8000/v1`` for a vLLM
    server. ``temperature`` and ``max_tokens`` are sent only when set; ``extra_body`` is
    merged into every request (e.g. ``{"top_k": 20}``). ``timeout_s`` bounds each request.

    Raises `PolicyError` (naming the URL, and the HTTP status where there is one) when the
    endpoint cannot be reached, times out, answers with an HTTP error, or with a body that
    is not a chat completion; `run_episodes` turns it into a ``policy_error`` fault.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        *,
        temperature: float | None = None,
        max_tokens: int | None = None,
        timeout_s: float = 600.0,
        extra_body: dict[str, Any] | None = None,
        max_concurrency: int = 64,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.api_key = api_key
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.extra_body = dict(extra_body or {})
        self.max_concurrency = max_concurrency
        self._pool: ThreadPoolExecutor | None = None
        self._tools = tool_schemas()

    def request_body(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """The JSON body sent for ``messages``."""
        body: dict[str, Any] = {"model": self.model, "messages": messages, "tools": self._tools}
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        body.update(self.extra_body)
        return body

    def _post(self, data: bytes) -> tuple[int, bytes]:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url, data, headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as e:
            try:
                payload = e.read()
            except (OSError, http.client.HTTPException):
                payload = b""
            return e.code, payload

    async def __call__(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        data = json.dumps(self.request_body(messages), ensure_ascii=False).encode("utf-8")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.max_concurrency, "openai-policy")
        where = f"POST {self.url}"
        future = asyncio.get_running_loop().run_in_executor(self._pool, self._post, data)
        timed_out = PolicyError(f"{where}: timed out, no response within {self.timeout_s:g} s")
        try:
            status, payload = await asyncio.wait_for(future, self.timeout_s)
        except TimeoutError:
            raise timed_out from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, TimeoutError):
                raise timed_out from None
            raise PolicyError(f"{where} failed: {e.reason}") from None
        except (OSError, http.client.HTTPException) as e:
            raise PolicyError(f"{where} failed: {type(e).__name__}: {e}") from None
        if status >= 400:
            raise PolicyError(f"{where} returned HTTP {status}: {_snippet(payload)}")
        try:
            doc = json.loads(payload)
        except ValueError:
            raise PolicyError(
                f"{where} returned HTTP {status} but the body is not JSON: {_snippet(payload)}"
            ) from None
        choices = doc.get("choices") if isinstance(doc, dict) else None
        first = choices[0] if isinstance(choices, list) and choices else None
        message = first.get("message") if isinstance(first, dict) else None
        if not isinstance(message, dict):
            raise PolicyError(
                f"{where} returned HTTP {status} without choices[0].message (an object): "
                f"{_snippet(payload)}"
            )
        return message

    def close(self) -> None:
        """Stop the worker threads (a later call starts new ones)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def __getstate__(self) -> dict[str, Any]:  # picklable (e.g. to a Ray actor): no threads
        return {**self.__dict__, "_pool": None}

    def __repr__(self) -> str:
        return f"OpenAIPolicy({self.url!r}, {self.model!r})"
