"""Long episodes: one context (a segment) at a time, and what replaces a full one.

An episode's context grows by a turn and a tool output at a time. When the next output would
take it past the compaction trigger (`CompactionConfig`), the context ends as a segment, one
training sequence of its own, and the episode goes on in a fresh one:

- ``summary``: the policy is first asked to summarise (a user turn in its chat format); what
  it writes is the segment's last turn, trained by the episode's reward like the rest
  (``train_summary``) or masked out of the loss. The fresh prompt is the system prompt and
  the task with the summary (and the last tool output) appended.
- ``sliding``: the fresh prompt is the first prompt and the most recent turns that fit.

A fresh context starts in a fresh engine slot: the old one, and its KV cache, is released
first (the episode does that). Every segment keeps the policy versions of its sampled tokens
and the experts of its fed tokens, so each one is scored and replayed like a whole episode.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from tandem.agent_env import EnvConfig, Task, opening_messages, tool_schemas
from tandem.orchestrator.compaction_config import CompactionConfig
from tandem.orchestrator.config_checks import ConfigValueError
from tandem.orchestrator.inference.formats import AnyChatFormat
from tandem.orchestrator.protocols import Engine
from tandem.orchestrator.wire import Compaction, Segment, TurnOutput

SUMMARY_HEADER = "Your summary of the work so far:"
LAST_OUTPUT_HEADER = "The last tool output:"


def truncate_observation(text: str, max_chars: int) -> str:
    """Keep the head and the tail of a long observation (what a small context can hold)."""
    if len(text) <= max_chars:
        return text
    keep = max_chars - 40
    head, tail = text[: keep // 2], text[-(keep - keep // 2) :]
    return f"{head}\n[... {len(text) - keep} characters cut ...]\n{tail}"


def render_observation(chat: AnyChatFormat, content: str, max_chars: int) -> list[int]:
    """A tool turn followed by the assistant header (the next generation prompt)."""
    ids, _ = chat.render_turn({"role": "tool", "content": truncate_observation(content, max_chars)})
    return ids + chat.header("assistant")


class SegmentBuilder:
    """The token stream of one context: prompt, sampled turns and observations, appended.

    ``heads``: where each assistant turn's header starts (the prompt ends with the first),
    so the context's turns can be cut out whole (`turns`)."""

    def __init__(self, prompt: Sequence[int], header_len: int) -> None:
        self.tokens = list(prompt)
        self.mask = [0] * len(prompt)
        self.logprobs = [0.0] * len(prompt)
        self.versions = [-1] * len(prompt)
        self.routes: list[np.ndarray] = []
        self.lo, self.hi = 1 << 62, -1
        self.header_len = header_len
        self.heads = [len(prompt) - header_len]

    def __len__(self) -> int:
        return len(self.tokens)

    def sampled(self, out: TurnOutput, *, trained: bool = True) -> None:
        """A generated turn (its tokens in the loss unless ``trained`` is False)."""
        self.routes.append(out.routes)
        self.lo, self.hi = min(self.lo, out.min_version), max(self.hi, out.max_version)
        self.tokens += out.tokens
        self.mask += [int(trained)] * len(out.tokens)
        self.logprobs += out.logprobs
        self.versions += out.versions

    def given(self, ids: Sequence[int], *, opens_turn: bool = False) -> None:
        """Tokens the policy did not generate (an observation, an instruction); with
        ``opens_turn`` they end with the next assistant header."""
        self.tokens += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)
        if opens_turn:
            self.heads.append(len(self.tokens) - self.header_len)

    def turns(self) -> list[list[int]]:
        """Each whole turn so far: its header, what was sampled, and the tool output."""
        return [self.tokens[a:b] for a, b in zip(self.heads, self.heads[1:], strict=False)]

    def segment(self) -> Segment:
        trace = np.concatenate(self.routes, axis=0)
        if trace.shape[0] != len(self.tokens) - 1:
            raise RuntimeError(
                f"routing trace covers {trace.shape[0]} tokens, expected {len(self.tokens) - 1}"
            )
        return Segment(
            tokens=self.tokens,
            loss_mask=self.mask,
            logprobs=self.logprobs,
            versions=self.versions,
            routes=trace,
            min_version=self.lo,
            max_version=self.hi,
        )


def summary_request(chat: AnyChatFormat, observation: list[int], instruction: str) -> list[int]:
    """The tool output's turn (``observation``, which ends with the assistant header; only
    the header when the output is left for the next context), the instruction as a user
    turn, and the assistant header the summary is sampled after."""
    header = chat.header("assistant")
    ask, _ = chat.render_turn({"role": "user", "content": instruction})
    return observation[: len(observation) - len(header)] + ask + header


def summary_text(chat: AnyChatFormat, turn: Sequence[int]) -> str:
    """The summary a turn holds (its text, special tokens dropped)."""
    body = list(turn[:-1]) if turn and turn[-1] == chat.end_id else list(turn)
    return chat.tok.decode(body, keep_special=False).strip()


def summary_messages(
    opening: Sequence[Mapping[str, Any]], summary: str, last_output: str | None
) -> list[dict[str, Any]]:
    """The fresh context's messages: the episode's opening (system prompt and task) with
    the summary, and the last tool output, appended to the task's text."""
    messages = [dict(m) for m in opening]
    parts = [str(messages[-1].get("content") or ""), f"{SUMMARY_HEADER}\n{summary}"]
    if last_output is not None:
        parts.append(f"{LAST_OUTPUT_HEADER}\n{last_output}")
    messages[-1]["content"] = "\n\n".join(parts)
    return messages


def sliding_prompt(
    prompt: Sequence[int], turns: Sequence[list[int]], budget: int, header: list[int]
) -> tuple[list[int], int]:
    """``prompt`` (which ends with ``header``) and the most recent whole ``turns`` (each
    opening with the header) within ``budget`` tokens, then the header; and how many turns
    it kept."""
    room = budget - len(prompt)
    kept = 0
    for turn in reversed(turns):
        if len(turn) > room:
            break
        kept, room = kept + 1, room - len(turn)
    out = list(prompt[: len(prompt) - len(header)])
    for turn in turns[len(turns) - kept :]:
        out += turn
    return out + header, kept


class Compactor:
    """Ends an episode's full context and builds its next one.

    ``opening``: the episode's first messages (system prompt and task); ``prompt``: their
    tokens with the generation prompt; ``schemas``: the tools, as the prompt was rendered."""

    def __init__(
        self,
        engine: Engine,
        chat: AnyChatFormat,
        config: CompactionConfig,
        *,
        opening: Sequence[Mapping[str, Any]],
        prompt: list[int],
        schemas: Sequence[Mapping[str, Any]],
        max_observation_chars: int,
        generator: torch.Generator,
    ) -> None:
        config.check_window(engine.max_len, field="compaction")
        self.engine, self.chat, self.config = engine, chat, config
        self.opening, self.prompt, self.schemas = list(opening), prompt, list(schemas)
        self.max_observation_chars = max_observation_chars
        self.generator = generator
        self.header = chat.header("assistant")
        self.trigger = config.trigger_tokens(engine.max_len)

    async def compact(
        self, slot: int, ctx: SegmentBuilder, closing: list[int], observation: list[int],
        output: str,
    ) -> tuple[Compaction, list[int], str]:  # fmt: skip
        """End ``ctx``, whose last sampled turn is to be followed by ``closing`` and the tool
        ``observation`` (of text ``output``). Returns the record, the fresh context's prompt,
        and why the episode ends instead ('' when it goes on)."""
        if self.config.mode == "sliding":
            return self._slide(ctx, closing, observation)
        return await self._summarise(slot, ctx, closing, observation, output)

    def _slide(
        self, ctx: SegmentBuilder, closing: list[int], observation: list[int]
    ) -> tuple[Compaction, list[int], str]:
        current = ctx.tokens[ctx.heads[-1] :] + closing + observation[: -len(self.header)]
        budget = int(self.config.keep_fraction * self.engine.max_len)
        prompt, kept = sliding_prompt(self.prompt, [*ctx.turns(), current], budget, self.header)
        record = Compaction(replaced=len(ctx) + len(closing) + len(observation), kept=len(prompt))
        return record, prompt, "" if kept else "context_limit"

    async def _summarise(
        self, slot: int, ctx: SegmentBuilder, closing: list[int], observation: list[int],
        output: str,
    ) -> tuple[Compaction, list[int], str]:  # fmt: skip
        cfg = self.config
        last_token = ctx.tokens[-1]
        request = summary_request(self.chat, observation, cfg.instruction)
        unseen = (
            len(ctx) + len(closing) + len(request) + cfg.summary_max_tokens > self.engine.max_len
        )
        if unseen:  # summarise before the output, which then opens the next context
            request = summary_request(self.chat, self.header, cfg.instruction)
        replaced = len(ctx) + len(closing) + (0 if unseen else len(observation) - len(self.header))
        out = await self.engine.generate(
            slot, [last_token, *closing, *request], self.generator, cfg.summary_max_tokens
        )
        ctx.given(closing + request)
        ctx.sampled(out, trained=cfg.train_summary)
        cut = out.truncated and out.tokens[-1] != self.chat.end_id
        last = None
        if cfg.keep_last_observation or unseen:
            last = truncate_observation(output, self.max_observation_chars)
        messages = summary_messages(self.opening, summary_text(self.chat, out.tokens), last)
        prompt, _ = self.chat.render(messages, add_generation_prompt=True, tools=self.schemas)
        record = Compaction(replaced=replaced, kept=len(prompt), summary=len(out.tokens), cut=cut)
        return record, prompt, "summary_too_long" if len(prompt) >= self.trigger else ""


def check_prompts(
    chat: AnyChatFormat,
    tasks: Sequence[Task],
    env: EnvConfig,
    max_len: int,
    config: CompactionConfig,
) -> None:
    """Raise `ConfigValueError` (one line, before any episode) for the first of ``tasks``
    whose prompt alone (system prompt, task, tool listing) reaches the point where its
    context is full (``engine.max_len``) or compacts (the trigger): no episode of it could
    take a turn. Episodes check their own prompt too, for the tasks not checked here."""
    limit = max_len if config.mode == "none" else config.trigger_tokens(max_len)
    schemas = tool_schemas()
    for task in tasks:
        prompt, _ = chat.render(
            opening_messages(task, env), add_generation_prompt=True, tools=schemas
        )
        if len(prompt) >= limit:
            where = "is full" if config.mode == "none" else "compacts"
            raise ConfigValueError(
                f"tasks: the prompt of task {task.id} alone is {len(prompt)} tokens, and its "
                f"context {where} at {limit} (engine.max_len = {max_len}, "
                f"episode.compaction.mode = {config.mode!r}): raise engine.max_len"
            )
