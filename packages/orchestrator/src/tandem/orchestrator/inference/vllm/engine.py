"""vLLM servers behind the `Engine` protocol: token ids in and out over HTTP.

Each slot is an episode's context, kept here: a turn sends the whole context to vLLM's
token-in/token-out endpoint (``/inference/v1/generate``), whose prefix cache holds the
earlier turns, so only the new tokens are computed. A slot stays on one server (its prefix
cache) when there are several; slots go to servers in turn.

What a turn returns matches the embedded engine's `TurnOutput`:
- log-probs of the sampled tokens after temperature (the server runs with
  ``--logprobs-mode processed_logprobs``);
- a seed per turn drawn from the episode's generator, so an episode's draws depend only on
  its seed (vLLM's sampler, not tandem's: the same seed gives other tokens than the
  embedded engine);
- the policy version of every token, from the server's weight-version spans (a version
  tandem did not set, such as vLLM's ``"default"``, counts as ``initial_version``);
- the turn ends at the stop token, the budget, or the first token ``keep_going`` rejects,
  applied to what the server returns (the tokens after it are dropped, as if never sampled);
- routes: the experts vLLM reports (``routed_experts``: on CUDA, where tandem starts its
  servers with them; vLLM records every layer, the MoE layers are kept), else -1 for every
  expert, which the trainer's R3 replay cannot use (it replays its own routes then: R2).
"""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import numpy as np
import torch

from tandem.moe_determinism.model.config import MoEConfig
from tandem.orchestrator.inference.engine_config import EngineConfig
from tandem.orchestrator.inference.formats import AnyChatFormat
from tandem.orchestrator.inference.vllm.errors import VllmReplyMismatch, VllmRequestRefused
from tandem.orchestrator.protocols import EngineStopped
from tandem.orchestrator.wire import TurnOutput

GENERATE = "/inference/v1/generate"
KEEPALIVE_S = 2.0
"""Idle connections are dropped before the server's own keep-alive timeout (5 s), which
would otherwise close a connection just as a request is sent on it."""
RETRIES = 3
"""Tries of a request that failed at the connection (nothing of the turn came back, so a
retry is the same request again); after them the server counts as stopped."""


class VllmEngine:
    """The `tandem.orchestrator.protocols.Engine` of one or more vLLM servers."""

    def __init__(
        self,
        urls: Sequence[str],
        config: EngineConfig,
        *,
        stop_id: int,
        vocab: int,
        model_vocab: int,
        route_shape: tuple[int, int],
        moe_layers: Sequence[int] = (),
        initial_version: int = 0,
    ) -> None:
        if not urls:
            raise ValueError("VllmEngine needs at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.config = config
        self.stop_id = stop_id
        self.route_shape = route_shape
        self.moe_layers = list(moe_layers)  # their indices among all layers (vLLM's rows)
        self.initial_version = initial_version
        # sample only the tokenizer's ids when the model's vocabulary is padded beyond it
        self._allowed = list(range(vocab)) if model_vocab > vocab else None
        self.model_vocab = model_vocab
        slots = config.max_slots * len(self.urls)
        self._free = list(range(slots))[::-1]
        self._slots = asyncio.Semaphore(slots)
        self._context: dict[int, list[int]] = {}
        self._client: httpx.AsyncClient | None = None
        self.tokens_fed = 0  # what each turn added to its context (vLLM's cache holds the rest)
        self.tokens_sampled = 0

    @classmethod
    def for_policy(
        cls,
        urls: Sequence[str],
        config: EngineConfig,
        model: MoEConfig,
        chat: AnyChatFormat,
        *,
        initial_version: int = 0,
    ) -> VllmEngine:
        """The engine for servers serving a policy of shape ``model`` in format ``chat``."""
        return cls(
            urls,
            config,
            stop_id=chat.end_id,
            vocab=chat.tok.vocab_size,
            model_vocab=model.vocab_size,
            route_shape=(len(model.moe_layers), model.num_experts_per_tok),
            moe_layers=model.moe_layers,
            initial_version=initial_version,
        )

    @property
    def max_len(self) -> int:
        return self.config.max_len

    def http(self) -> httpx.AsyncClient:
        """The client of this engine's event loop (made on first use, in that loop)."""
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(self.config.vllm.request_timeout_s, connect=10.0),
                limits=httpx.Limits(
                    max_connections=self.config.max_slots * len(self.urls),
                    keepalive_expiry=KEEPALIVE_S,
                ),
            )
        return self._client

    async def acquire(self) -> int:
        await self._slots.acquire()
        slot = self._free.pop()
        self._context[slot] = []
        return slot

    def release(self, slot: int) -> None:
        self._context.pop(slot, None)
        self._free.append(slot)
        self._slots.release()

    async def generate(
        self,
        slot: int,
        feed: list[int],
        generator: torch.Generator,
        max_new_tokens: int,
        keep_going: Callable[[int], bool] | None = None,
    ) -> TurnOutput:
        if not feed:
            raise ValueError("a turn must feed at least one token")
        bad = [t for t in feed if not 0 <= t < self.model_vocab]
        if bad:  # vLLM's engine dies on such an id instead of refusing the request
            raise ValueError(
                f"slot {slot}: token ids {bad[:5]} are outside the model's vocabulary "
                f"(0..{self.model_vocab - 1})"
            )
        context = self._context[slot]
        before = len(context)
        prompt = context + list(feed)
        room = self.config.max_len - len(prompt)
        if room < 1:
            raise ValueError(
                f"slot {slot}: {len(feed)} new tokens do not fit in the context "
                f"({before} of {self.config.max_len} used)"
            )
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
        params: dict[str, Any] = {
            "temperature": self.config.temperature,
            "max_tokens": max(1, min(max_new_tokens, room)),
            "seed": seed,
            "logprobs": 0,
            "stop_token_ids": [self.stop_id] if self.stop_id >= 0 else [],
            "detokenize": False,
        }
        if self._allowed is not None:
            params["allowed_token_ids"] = self._allowed
        body = {"token_ids": prompt, "sampling_params": params}
        choice = await self._post(self.urls[slot % len(self.urls)], body)
        out = self._turn(choice, len(feed), before, keep_going)
        self.tokens_fed += len(feed) + len(out.tokens) - 1
        self.tokens_sampled += len(out.tokens)
        context.extend(feed)
        context.extend(out.tokens[:-1])  # the last sampled token is fed by the next turn
        return out

    async def _post(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        for attempt in range(RETRIES):
            try:
                r = await self.http().post(url + GENERATE, json=body)
                break
            except httpx.TimeoutException as e:
                raise EngineStopped(f"vLLM server {url} did not answer in time: {e!r}") from None
            except httpx.TransportError as e:
                if attempt == RETRIES - 1:
                    raise EngineStopped(f"vLLM server {url} did not answer: {e!r}") from None
                await asyncio.sleep(0.1 * (attempt + 1))
        if 400 <= r.status_code < 500:
            raise VllmRequestRefused(
                f"vLLM server {url} refused a turn (HTTP {r.status_code}): {r.text[:500]}"
            )
        if r.status_code != 200:
            raise EngineStopped(f"vLLM server {url} answered HTTP {r.status_code}: {r.text[:500]}")
        choices = r.json().get("choices") or []
        if len(choices) != 1:
            raise EngineStopped(f"vLLM server {url} returned {len(choices)} choices, not 1")
        return dict(choices[0])

    def _turn(
        self,
        choice: dict[str, Any],
        fed: int,
        before: int,
        keep_going: Callable[[int], bool] | None,
    ) -> TurnOutput:
        tokens = [int(t) for t in choice.get("token_ids") or []]
        content = (choice.get("logprobs") or {}).get("content") or []
        if not tokens or len(content) != len(tokens):
            raise EngineStopped(
                f"vLLM returned {len(tokens)} tokens and {len(content)} log-probs for a turn"
            )
        logprobs = [float(c["logprob"]) for c in content]
        versions = self._versions(choice.get("weight_versions"), len(tokens))
        keep = len(tokens)
        if keep_going is not None:
            for i, tok in enumerate(tokens):
                if tok != self.stop_id and not keep_going(tok):
                    keep = i + 1
                    break
        tokens, logprobs, versions = tokens[:keep], logprobs[:keep], versions[:keep]
        rows = fed + len(tokens) - 1  # every fed token, and every sampled one but the last
        return TurnOutput(
            tokens=tokens,
            logprobs=logprobs,
            versions=versions,
            routes=self._routes(choice.get("routed_experts"), before, rows),
            min_version=min(versions),
            max_version=max(versions),
            truncated=tokens[-1] != self.stop_id,
        )

    def _versions(self, spans: list[dict[str, Any]] | None, n: int) -> list[int]:
        versions = [self.initial_version] * n
        for span in spans or []:
            v = str(span.get("version", ""))
            version = int(v) if v.isdigit() else self.initial_version
            for i in range(max(0, int(span["start"])), min(n, int(span["end"]))):
                versions[i] = version
        return versions

    def _routes(self, encoded: str | None, before: int, rows: int) -> np.ndarray:
        """The experts of this turn's rows: vLLM's rows cover the whole request (context
        and output but the last token) and every layer, a dense one included."""
        layers, top_k = self.route_shape
        if not encoded:
            return np.full((rows, layers, top_k), -1, dtype=np.int16)
        routes = np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)
        every_layer = (
            self.moe_layers and routes.ndim == 3 and routes.shape[1] > max(self.moe_layers)
        )
        if every_layer and routes.shape[1] != layers:
            routes = routes[:, self.moe_layers]
        if routes.ndim != 3 or routes.shape[1:] != (layers, top_k) or len(routes) < before + rows:
            raise VllmReplyMismatch(
                f"vLLM reported routed experts of shape {routes.shape}; a turn of {rows} new "
                f"rows after {before} needs at least {before + rows} rows of {layers} MoE "
                f"layers x {top_k} experts (is the server serving this policy?)"
            )
        return routes[before : before + rows].astype(np.int16)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
