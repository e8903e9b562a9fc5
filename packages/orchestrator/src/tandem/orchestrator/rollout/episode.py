"""One agent episode driven by the engine: token-in/token-out, every turn in one KV slot.

The episode's token stream is built once and only appended to: the prompt (system + task)
rendered by the policy's chat format, then per turn the exact tokens the engine sampled, then
the tool observation and the next assistant header. History is never re-rendered, so what the trainer
sees is exactly what the engine saw and produced (re-rendering chat templates is how
multi-turn RL silently goes off-policy).

The policy's text is parsed into an agent-env tool call; output that is not exactly one
well-formed call becomes an error observation that costs the turn.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tandem.agent_env import Env, EnvConfig, Task
from tandem.agent_env import ToolCall as EnvToolCall
from tandem.orchestrator.inference.call_prefix import prefix_check, tool_arguments
from tandem.orchestrator.inference.chat_format import ToolCallFormatError
from tandem.orchestrator.inference.formats import AnyChatFormat
from tandem.orchestrator.protocols import Engine
from tandem.orchestrator.wire import Sample

FORMAT_ERROR_TOOL = "invalid_tool_call"


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
) -> Sample:
    """Play ``task`` to the end with the engine's current policy, token in and token out,
    and return the scored sample (agent-env's `run_episode` plays a policy of messages).

    ``open_env`` makes the episode's environment (an `Env` here, or one with its interface
    whose sandbox runs elsewhere).

    With ``stop_malformed``, each turn ends at its first token that rules out a well-formed
    call (`CallPrefix`, in the byte format); the turn then fails to parse as it would have at
    the token budget.
    """
    t0 = time.monotonic()
    env = open_env(task, env_config)
    slot = await engine.acquire()
    try:
        await env.reset()
        schemas = env.tool_schemas()
        tools = tool_arguments(schemas) if stop_malformed else None
        prompt, _ = chat.render(env.messages, add_generation_prompt=True, tools=schemas)
        tokens, mask = list(prompt), [0] * len(prompt)
        logprobs, versions = [0.0] * len(prompt), [-1] * len(prompt)
        routes: list[np.ndarray] = []
        feed = list(prompt)
        lo, hi = 1 << 62, -1
        format_errors = 0
        termination = ""
        while True:
            check = prefix_check(chat, tools) if tools is not None else None
            out = await engine.generate(slot, feed, generator, max_new_tokens, check)
            routes.append(out.routes)
            lo, hi = min(lo, out.min_version), max(hi, out.max_version)
            tokens += out.tokens
            mask += [1] * len(out.tokens)
            logprobs += out.logprobs
            versions += out.versions
            call, error = to_env_call(chat, out.tokens)
            result = await env.step(call)
            if error is not None:
                format_errors += 1
                env.messages[-1]["content"] = f"error: {error}"
            if result.done:
                break
            observation = render_observation(
                chat, env.messages[-1]["content"], max_observation_chars
            )
            closing = [] if out.tokens[-1] == chat.end_id else [chat.end_id]
            if len(tokens) + len(closing) + len(observation) + 8 >= engine.max_len:
                termination = "context_limit"
                break
            # The last sampled token has not been fed yet: it opens the next feed.
            feed = [out.tokens[-1], *closing, *observation]
            tokens += closing + observation
            mask += [0] * (len(closing) + len(observation))
            logprobs += [0.0] * (len(closing) + len(observation))
            versions += [-1] * (len(closing) + len(observation))
        traj = env.trajectory()
    finally:
        engine.release(slot)
        await asyncio.shield(env.close())
    if termination:
        reward, resolved, infra = 0.0, False, False
    else:
        termination = traj.termination
        infra = traj.infra_fault or traj.reward is None
        reward, resolved = float(traj.reward or 0.0), bool(traj.resolved)
    trace = np.concatenate(routes, axis=0)
    if trace.shape[0] != len(tokens) - 1:
        raise RuntimeError(
            f"routing trace covers {trace.shape[0]} tokens, expected {len(tokens) - 1}"
        )
    return Sample(
        task_id=task.id,
        tokens=tokens,
        loss_mask=mask,
        logprobs=logprobs,
        versions=versions,
        routes=trace,
        reward=reward,
        resolved=resolved,
        turns=traj.turns,
        termination=termination,
        min_version=lo,
        max_version=hi,
        format_errors=format_errors,
        tool_errors=sum(1 for step in traj.steps if step.is_error),
        infra_fault=infra,
        wall_s=time.monotonic() - t0,
        messages=traj.messages,
    )
