"""The embedded inference engine: continuous batched decoding with a KV cache per episode.

Each episode holds a cache slot for its whole life, so earlier turns are never recomputed:
a new turn only feeds the tokens not yet seen (the last sampled token, the tool observation
and the next assistant header). Every `step` runs one forward over all active sequences (a
prefill of a new turn and a one-token decode are the same call) and samples one token per
sequence. What comes back is exact: the token ids, the log-prob of each sampled token under
the policy that sampled it, the policy version that produced it, and the experts every fed
token was routed to (the routing trace the trainer replays).

Sampling is seeded per episode (a `torch.Generator` of its own, Gumbel-max over the
vocabulary), so an episode's tokens do not depend on which other episodes share its batch;
its log-probs come from moe-determinism's `sampling_logits` and `target_logprobs`, the two
functions the trainer scores with.
Under ``deterministic`` the forward runs inside `batch_invariant()`, which is what makes
the engine's log-probs the trainer's log-probs bit for bit.

New weights arrive as a prepared delta-sync version (downloaded and decoded while serving);
`step` applies it between two decoding steps (the pause), optionally in the middle of
episodes (``update_mid_rollout``).

With ``share_prefixes`` a turn whose tokens continue what another slot's cache already
holds at the current version copies those keys, values and routes (`PrefixIndex`) instead
of prefilling them: a GRPO group's samples compute their shared prompt once. Under
``deterministic`` the copied rows are the ones the slot would compute, bit for bit. The copies
are recorded in the cache (`KVCache.origins`), so decoding then reads each shared KV split
once per step for the whole group instead of once per sample.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tandem.moe_determinism import (
    MoETransformer,
    batch_invariant,
    sampling_logits,
    target_logprobs,
)
from tandem.orchestrator.config import EngineConfig
from tandem.orchestrator.inference.embedded.prefix_cache import DEFER_MIN_TOKENS, PrefixIndex
from tandem.orchestrator.shards import ShardViews
from tandem.orchestrator.wire import TurnOutput


class EngineError(RuntimeError):
    """The engine was asked for something it cannot do (no free slot, context full, ...)."""


@dataclass
class _Active:
    slot: int
    to_feed: list[int]
    max_new_tokens: int
    generator: torch.Generator
    keep_going: Callable[[int], bool] | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routes: list[np.ndarray] = field(default_factory=list)
    min_version: int = 1 << 62
    max_version: int = -1


@dataclass
class EngineStats:
    """Counters for throughput and weight-update figures."""

    forward_passes: int = 0
    tokens_fed: int = 0
    tokens_reused: int = 0
    tokens_sampled: int = 0
    forward_seconds: float = 0.0
    updates: int = 0
    pause_seconds: list[float] = field(default_factory=list)


class InferenceEngine:
    """Batched generation over a fixed number of KV-cache slots.

    One thread steps it; `acquire`, `release`, `cancel`, `submit` and `stage_update` may be
    called from another (the event loop) while a step runs: they touch only the slot lists
    and request queues, under a lock, never the cache a step reads."""

    def __init__(
        self,
        model: MoETransformer,
        config: EngineConfig,
        *,
        stop_id: int,
        version: int = 0,
        vocab: int | None = None,
    ) -> None:
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.config = config
        self.stop_id = stop_id
        self.version = version
        self.vocab = vocab  # ids past it (a padded embedding's) are never sampled
        self.cache = model.new_cache(config.max_slots, config.max_len)
        # inputs go to the weights' device; what comes back (tokens, log-probs, routes) and the
        # episodes' generators stay on the host, so a seed samples the same on CPU and GPU
        self.device = next(self.model.parameters()).device
        mc = model.config
        self.route_dtype = np.uint8 if mc.num_experts <= 256 else np.int32
        self.prefixes = (
            PrefixIndex(
                self.cache.lengths.numpy(),  # shares the cache's memory
                config.max_len,
                (len(mc.moe_layers), mc.num_experts_per_tok),  # routes: MoE layers only
                self.route_dtype,
            )
            if config.share_prefixes
            else None
        )
        # least recently released first: a released slot's cache stays a prefix donor longest
        self._free = collections.deque(range(config.max_slots))
        # acquired slots whose cache `step` has yet to clear (see `acquire`)
        self._fresh: set[int] = set()
        self._active: dict[int, _Active] = {}
        self._incoming: list[_Active] = []
        self._lock = threading.Lock()
        self._pending: Any = None  # a delta-sync `Prepared`
        self._pending_version: int | None = None
        self.stats = EngineStats()
        self.state = dict(self.model.state_dict())
        self.on_apply: Callable[[int, dict[str, torch.Tensor]], None] | None = None

    # -- slots -----------------------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        """A fresh slot for a new episode.

        Its cache is cleared by `step`, before the step admits any turn, never here:
        clearing a slot rewrites which slots other slots read their shared KV splits from
        (`KVCache.origins`) and the prefix index, and a step running meanwhile in the
        serving thread may be reading them or copying a prefix from this very slot.
        """
        with self._lock:
            if not self._free:
                raise EngineError(
                    f"all {self.config.max_slots} slots are in use; raise engine.max_slots or "
                    "run fewer episodes at once"
                )
            slot = self._free.popleft()
            self._fresh.add(slot)
        return slot

    def _clear_fresh_slots(self) -> None:
        """Clear the caches of the slots acquired since the last step (holding the lock)."""
        for slot in sorted(self._fresh):
            self.cache.reset(slot)
            if self.prefixes is not None:
                self.prefixes.reset(slot)
        self._fresh.clear()

    def release(self, slot: int) -> None:
        with self._lock:
            if slot in self._active or any(a.slot == slot for a in self._incoming):
                raise EngineError(f"slot {slot} is still generating")
            self._free.append(slot)

    def cancel(self, slot: int) -> None:
        """Forget any turn ``slot`` is generating (its episode was abandoned)."""
        with self._lock:
            self._active.pop(slot, None)
            self._incoming = [a for a in self._incoming if a.slot != slot]

    def context_length(self, slot: int) -> int:
        with self._lock:
            if slot in self._fresh:
                return 0
        return int(self.cache.lengths[slot])

    # -- requests --------------------------------------------------------------------------
    def submit(
        self,
        slot: int,
        feed: list[int],
        generator: torch.Generator,
        max_new_tokens: int,
        keep_going: Callable[[int], bool] | None = None,
    ) -> None:
        """Queue a turn: feed ``feed`` into ``slot``'s cache, then sample until the stop token.

        ``keep_going``: called with each sampled token; the turn also ends (as truncated)
        at the first token for which it returns False.
        """
        if not feed:
            raise EngineError("a turn must feed at least one token")
        room = self.config.max_len - self.context_length(slot) - len(feed)
        if room < 1:
            raise EngineError(
                f"slot {slot}: {len(feed)} new tokens do not fit in the context "
                f"({self.context_length(slot)} of {self.config.max_len} used)"
            )
        request = _Active(
            slot, list(feed), max(1, min(max_new_tokens, room)), generator, keep_going
        )
        with self._lock:
            self._incoming.append(request)

    @property
    def busy(self) -> bool:
        with self._lock:
            return bool(self._active or self._incoming)

    # -- weights ---------------------------------------------------------------------------
    def stage_update(self, prepared: Any) -> None:
        """Hand over a prepared version; `step` applies it at the next allowed boundary."""
        with self._lock:
            self._pending = prepared
            self._pending_version = int(prepared.version)

    @property
    def pending_version(self) -> int | None:
        return self._pending_version

    def apply_pending(self) -> Any:
        """Apply a staged version now (the caller guarantees no forward is running)."""
        with self._lock:
            prepared, self._pending = self._pending, None
        if prepared is None:
            return None
        try:
            report = prepared.apply(ShardViews(self.state))  # a sharded trainer's parts too
            self.version = int(prepared.version)
        finally:
            # cleared only now (a pull waiting for it must not prepare from the old base),
            # and only if no other version was staged meanwhile
            with self._lock:
                if self._pending is None:
                    self._pending_version = None
        self.stats.updates += 1
        self.stats.pause_seconds.append(report.apply_seconds)
        if self.on_apply is not None:
            self.on_apply(self.version, self.state)
        return report

    def load_state(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Copy full weights in (start-up and resume)."""
        with torch.no_grad():
            for name, tensor in self.state.items():
                tensor.copy_(state[name])
        self.version = version

    # -- decoding --------------------------------------------------------------------------
    def step(self) -> list[tuple[int, TurnOutput]]:
        """One decoding step of every active sequence; returns the turns that finished.

        Sequences that are decoding (one token to feed) and those that are prefilling (a
        prompt or an observation) run as separate forwards: in one batch every sequence would
        be padded to the longest feed, so a single prefill would make each decoding sequence
        pay for hundreds of query rows. Under `batch_invariant()` the split changes no bit.
        """
        with self._lock:
            may_update = self._pending is not None and (
                self.config.update_mid_rollout or not self._active
            )
        if may_update:
            self.apply_pending()
        with self._lock:
            self._clear_fresh_slots()
            admitted: list[_Active] = []
            waiting = [req for req in self._incoming if not self._admit(req, admitted)]
            for req in admitted:
                self._active[req.slot] = req
            self._incoming = waiting
            active = list(self._active.values())
        if not active:
            return []
        decoding = [a for a in active if len(a.to_feed) == 1]
        prefilling = [a for a in active if len(a.to_feed) > 1]
        results = []
        for batch in (decoding, prefilling):
            if batch:
                results += zip(batch, *self._forward(batch), strict=True)
        return [done for done in map(self._advance, results) if done is not None]

    def _admit(self, req: _Active, admitted: list[_Active]) -> bool:
        """Start ``req`` this step, after copying what another slot already computed of it;
        False (wait a step) when a turn admitted this step will compute a longer prefix."""
        if self.prefixes is None:
            admitted.append(req)
            return True
        donor, count = self.prefixes.match(req.slot, req.to_feed, self.version)
        pending = (req.slot, req.to_feed)
        ahead = max(
            (self.prefixes.shared_run((a.slot, a.to_feed), pending) for a in admitted), default=0
        )
        if ahead - count >= DEFER_MIN_TOKENS:
            return False
        if count:
            end = int(self.cache.lengths[req.slot]) + count  # fresh slots are clear now
            self.cache.copy_prefix(donor, req.slot, end)
            req.routes.append(self.prefixes.take(donor, req.slot, count))
            req.to_feed = req.to_feed[count:]
            req.min_version = min(req.min_version, self.version)
            req.max_version = max(req.max_version, self.version)
            self.stats.tokens_reused += count
        admitted.append(req)
        return True

    def _forward(self, batch: list[_Active]) -> tuple[list[np.ndarray], list[int], list[float]]:
        """One forward over ``batch``: each request's routes, sampled token and its log-prob."""
        feeds = [a.to_feed for a in batch]
        dev = self.device
        flat = torch.tensor([t for f in feeds for t in f], dtype=torch.long, device=dev)
        bounds = [0, *np.cumsum([len(f) for f in feeds]).tolist()]
        cu = torch.tensor(bounds, dtype=torch.long, device=dev)
        # slots index the cache's lengths, which stay on the host
        slots = torch.tensor([a.slot for a in batch], dtype=torch.long)
        t0 = time.perf_counter()
        with torch.no_grad(), batch_invariant(self.config.deterministic):
            out = self.model(flat, cu_seqlens=cu, cache=self.cache, slots=slots)
            last = out.logits[cu[1:] - 1]
            tokens, logprobs = self._sample(last, batch)
        self.stats.forward_seconds += time.perf_counter() - t0
        self.stats.forward_passes += 1
        self.stats.tokens_fed += int(flat.numel())
        self.stats.tokens_sampled += len(batch)
        routes = out.route_ids.cpu().numpy().astype(self.route_dtype)
        per_request = [routes[i:j] for i, j in itertools.pairwise(bounds)]
        if self.prefixes is not None:
            for a, fed, r in zip(batch, feeds, per_request, strict=True):
                self.prefixes.record(a.slot, fed, r, self.version)
        return per_request, tokens, logprobs

    def _advance(
        self, result: tuple[_Active, np.ndarray, int, float]
    ) -> tuple[int, TurnOutput] | None:
        """Record a request's new token; its finished turn, if this token ended it."""
        a, routes, tok, lp = result
        a.routes.append(routes)
        a.tokens.append(tok)
        a.logprobs.append(lp)
        a.versions.append(self.version)
        a.min_version = min(a.min_version, self.version)
        a.max_version = max(a.max_version, self.version)
        full = int(self.cache.lengths[a.slot]) + 1 >= self.config.max_len
        cut = a.keep_going is not None and not a.keep_going(tok)
        if tok == self.stop_id or len(a.tokens) >= a.max_new_tokens or full or cut:
            return a.slot, self._finish(a, truncated=tok != self.stop_id)
        a.to_feed = [tok]
        return None

    def _sample(self, logits: torch.Tensor, active: list[_Active]) -> tuple[list[int], list[float]]:
        temperature = self.config.temperature
        scaled = sampling_logits(logits, temperature, self.vocab)
        if temperature == 0.0:
            tokens = scaled.argmax(-1)
        else:
            noise = torch.stack(
                [torch.rand(scaled.shape[-1], generator=a.generator) for a in active]
            ).to(scaled.device)
            gumbel = -torch.log(-torch.log(noise.clamp_min(1e-20)))
            tokens = (scaled + gumbel).argmax(-1)
        lp = target_logprobs(scaled, tokens)
        return tokens.tolist(), lp.tolist()

    def _finish(self, a: _Active, *, truncated: bool) -> TurnOutput:
        with self._lock:
            self._active.pop(a.slot, None)
        return TurnOutput(
            tokens=a.tokens,
            logprobs=a.logprobs,
            versions=a.versions,
            routes=np.concatenate(a.routes, axis=0),
            min_version=a.min_version,
            max_version=a.max_version,
            truncated=truncated,
        )
