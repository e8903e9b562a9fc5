"""One agent episode driven by the engine: token-in/token-out, a context's turns in one KV slot.

The episode's token stream is built once and only appended to: the prompt (system + task)
rendered by the policy's chat format, then per turn the exact tokens the engine sampled, then
the tool observation and the next assistant header. History is never re-rendered, so what the trainer
sees is exactly what the engine saw and produced (re-rendering chat templates is how
multi-turn RL silently goes off-policy).

The policy's text is parsed into an agent-env tool call; output that is not exactly one
well-formed call becomes an error observation that costs the turn. A context that fills
is compacted (`rollout.compaction`): the episode goes on in a fresh context and slot, and
returns every context it used as one training segment.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import torch

from tandem.agent_env import Env, EnvConfig, Task
from tandem.agent_env import ToolCall as EnvToolCall
from tandem.orchestrator.compaction_config import CompactionConfig
from tandem.orchestrator.inference.call_prefix import prefix_check, tool_arguments
from tandem.orchestrator.inference.chat_format import ToolCallFormatError
from tandem.orchestrator.inference.formats import AnyChatFormat
from tandem.orchestrator.protocols import Engine
from tandem.orchestrator.rollout.compaction import (
    Compactor,
    SegmentBuilder,
    render_observation,
    truncate_observation,
)
from tandem.orchestrator.wire import Compaction, Sample, Segment

__all__ = [
    "FORMAT_ERROR_TOOL",
    "episode_generator",
    "render_observation",
    "run_token_episode",
    "to_env_call",
    "truncate_observation",
]

FORMAT_ERROR_TOOL = "invalid_tool_call"


def episode_generator(seed: int, *keys: int) -> torch.Generator:
    """A sampling RNG that depends only on (seed, keys): the same episode, the same draws."""
    mixed = seed
    for k in keys:
        mixed = (mixed * 1_000_003 + k + 0x9E3779B9) % (1 << 62)
    return torch.Generator().manual_seed(mixed)


def to_env_call(chat: AnyChatFormat, turn: list[int]) -> tuple[EnvToolCall, str | None]:
    """The agent-env call for a generated turn, or a placeholder and the format error."""
    try:
        parsed = chat.parse_assistant(turn)
    except ToolCallFormatError as e:
        text = chat.tok.decode(turn, keep_special=False)
        return EnvToolCall(name=FORMAT_ERROR_TOOL, arguments="{}", content=text or None), str(e)
    call = parsed.tool_call
    return (
        EnvToolCall(
            name=call.name,
            arguments=json.dumps(call.arguments, ensure_ascii=False),
            content=parsed.content or None,
        ),
        None,
    )


async def run_token_episode(
    engine: Engine,
    chat: AnyChatFormat,
    task: Task,
    env_config: EnvConfig,
    *,
    max_new_tokens: int,
    max_observation_chars: int,
    generator: torch.Generator,
    stop_malformed: bool = True,
    open_env: Callable[[Task, EnvConfig], Any] = Env,
    compaction: CompactionConfig | None = None,
) -> Sample:
    """Play ``task`` to the end with the engine's current policy, token in and token out,
    and return the scored sample (agent-env's `run_episode` plays a policy of messages).

    ``open_env`` makes the episode's environment (an `Env` here, or one with its interface
    whose sandbox runs elsewhere).

    With ``stop_malformed``, each turn ends at its first token that rules out a well-formed
    call (`CallPrefix`, in the byte format); the turn then fails to parse as it would have at
    the token budget.

    ``compaction``: what happens when the context fills (`rollout.compaction`); without it,
    or in mode ``none``, the episode ends there (``context_limit``, reward 0).
    """
    t0 = time.monotonic()
    compaction = compaction or CompactionConfig()
    header = chat.header("assistant")
    env = open_env(task, env_config)
    slot = await engine.acquire()
    segments: list[Segment] = []
    records: list[Compaction] = []
    try:
        await env.reset()
        schemas = env.tool_schemas()
        tools = tool_arguments(schemas) if stop_malformed else None
        prompt, _ = chat.render(env.messages, add_generation_prompt=True, tools=schemas)
        compactor = None
        if compaction.mode != "none":
            compactor = Compactor(
                engine, chat, compaction, opening=env.messages, prompt=prompt, schemas=schemas,
                max_observation_chars=max_observation_chars, generator=generator,
            )  # fmt: skip
        limit = compactor.trigger if compactor else engine.max_len
        if len(prompt) >= limit:
            raise ValueError(
                f"task {task.id}: its prompt alone is {len(prompt)} tokens, and the context "
                f"{'compacts' if compactor else 'is full'} at {limit} "
                f"(engine.max_len = {engine.max_len})"
            )
        ctx = SegmentBuilder(prompt, len(header))
        feed = list(prompt)
        format_errors = 0
        termination = ""
        while True:
            check = prefix_check(chat, tools) if tools is not None else None
            out = await engine.generate(slot, feed, generator, max_new_tokens, check)
            ctx.sampled(out)
            call, error = to_env_call(chat, out.tokens)
            result = await env.step(call)
            if error is not None:
                format_errors += 1
                env.messages[-1]["content"] = f"error: {error}"
            if result.done:
                break
            output = env.messages[-1]["content"]
            observation = render_observation(chat, output, max_observation_chars)
            closing = [] if out.tokens[-1] == chat.end_id else [chat.end_id]
            grown = len(ctx) + len(closing) + len(observation)
            if compactor is not None and grown >= compactor.trigger:
                record, prompt, why = await compactor.compact(
                    slot, ctx, closing, observation, output
                )
                engine.release(slot)  # the old context's KV cache goes with its slot
                slot = -1
                segments.append(ctx.segment())
                records.append(record)
                if why:
                    termination = why
                    break
                slot = await engine.acquire()
                ctx, feed = SegmentBuilder(prompt, len(header)), list(prompt)
                continue
            if grown + 8 >= engine.max_len:
                termination = "context_limit"
                break
            # The last sampled token has not been fed yet: it opens the next feed.
            feed = [out.tokens[-1], *closing, *observation]
            ctx.given(closing + observation, opens_turn=True)
        traj = env.trajectory()
    finally:
        if slot >= 0:
            engine.release(slot)
        await asyncio.shield(env.close())
    if termination:
        reward, resolved, infra = 0.0, False, False
    else:
        termination = traj.termination
        infra = traj.infra_fault or traj.reward is None
        reward, resolved = float(traj.reward or 0.0), bool(traj.resolved)
    # An episode that ended at a compaction has no context after its last segment.
    last = segments.pop() if slot < 0 else ctx.segment()
    return Sample(
        task_id=task.id,
        tokens=last.tokens,
        loss_mask=last.loss_mask,
        logprobs=last.logprobs,
        versions=last.versions,
        routes=last.routes,
        reward=reward,
        resolved=resolved,
        turns=traj.turns,
        termination=termination,
        min_version=min(seg.min_version for seg in [*segments, last]),
        max_version=max(seg.max_version for seg in [*segments, last]),
        format_errors=format_errors,
        tool_errors=sum(1 for step in traj.steps if step.is_error),
        infra_fault=infra,
        wall_s=time.monotonic() - t0,
        messages=traj.messages,
        prior_segments=segments,
        compactions=records,
        last_min_version=last.min_version if segments else -1,
        last_max_version=last.max_version if segments else -1,
    )
