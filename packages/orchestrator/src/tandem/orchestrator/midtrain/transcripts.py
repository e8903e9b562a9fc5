"""Oracle transcripts: agent-env's oracle solving generated tasks, in the policy's own format.

The oracle applies each task's reference fix through the real tools in the real sandbox, so
the observations are what the policy will see in RL. Rendering follows the RL token stream
exactly (same chat format, same observation truncation, nothing after the final call), so
mid-training teaches the format the engine will be parsed against.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import structlog

from tandem.agent_env import (
    EnvConfig,
    OraclePolicy,
    Task,
    ToolCall,
    Trajectory,
    oracle_script,
    run_episodes,
    tool_schemas,
)
from tandem.orchestrator.compaction_config import CompactionConfig
from tandem.orchestrator.inference.formats import AnyChatFormat
from tandem.orchestrator.midtrain.detours import Edit, plan_detours
from tandem.orchestrator.midtrain.summaries import compacted_transcript
from tandem.orchestrator.rollout.compaction import truncate_observation

log = structlog.get_logger()


def condense(messages: Sequence[dict[str, Any]], skip_tools: Sequence[str]) -> list[dict[str, Any]]:
    """Drop the calls to read-only tools in ``skip_tools`` (and their observations).

    Skipping a call that changes nothing in the workspace (listing a directory, running the
    visible tests) leaves every later observation exactly as the environment produced it, so
    the result is the faithful transcript of a shorter oracle; a small model then learns the
    calls that decide the outcome from shorter sequences.
    """
    out: list[dict[str, Any]] = []
    skipped: set[str] = set()
    for m in messages:
        calls = m.get("tool_calls") or []
        if m.get("role") == "assistant" and calls and calls[0]["function"]["name"] in skip_tools:
            skipped.add(calls[0]["id"])
            continue
        if m.get("role") == "tool" and m.get("tool_call_id") in skipped:
            continue
        out.append(dict(m))
    return out


def fit_turns(messages: Sequence[dict[str, Any]], max_turns: int) -> list[dict[str, Any]] | None:
    """The episode as a policy with ``max_turns`` calls would play it, or None if it cannot.

    The environment grades an episode when its turn budget runs out, so a closing `submit`
    beyond the budget changes nothing: it is dropped. Any other call beyond the budget means
    the oracle needed more turns than the policy has, and the transcript would not solve the
    task within them (None).
    """
    calls = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if len(calls) <= max_turns:
        return list(messages)
    for i in calls[max_turns:]:
        names = [c["function"]["name"] for c in messages[i].get("tool_calls") or []]
        if names != ["submit"]:
            return None
    return list(messages[: calls[max_turns]])


def transcript_messages(
    messages: Sequence[dict[str, Any]], max_observation_chars: int, skip_tools: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """A finished episode's messages as the engine's token stream holds them: condensed,
    each tool output truncated, ending with the policy's last call."""
    msgs = condense(messages, skip_tools)
    while msgs and msgs[-1].get("role") == "tool":
        msgs.pop()  # the episode ends with the policy's last call
    for m in msgs:
        if m.get("role") == "tool":
            m["content"] = truncate_observation(m.get("content") or "", max_observation_chars)
    return msgs


def render_transcript(
    chat: AnyChatFormat,
    messages: Sequence[dict[str, Any]],
    max_observation_chars: int,
    skip_tools: Sequence[str] = (),
) -> tuple[list[int], list[int]]:
    """(ids, loss_mask) of a finished episode, as the engine's token stream would hold it
    (the prompt lists the environment's tools, as a rollout's does)."""
    msgs = transcript_messages(messages, max_observation_chars, skip_tools)
    return chat.render(msgs, tools=tool_schemas())


def minimal_edit(text: str, old: str, new: str, min_chars: int = 10) -> tuple[str, str]:
    """The shortest (old, new) pair, on word boundaries, that makes the same change to ``text``.

    The reference fix replaces whole lines; a policy that only has to copy the few characters
    around the change (``number > 1`` -> ``number > 0``), extended until they match once in
    the file and are at least ``min_chars`` long (enough context to say *where*), learns the
    fix from far fewer examples. Returns ``(old, new)`` unchanged when ``old`` does not occur
    exactly once.
    """
    if text.count(old) != 1 or old == new:
        return old, new
    pre = 0
    while pre < min(len(old), len(new)) and old[pre] == new[pre]:
        pre += 1
    suf = 0
    while suf < min(len(old), len(new)) - pre and old[-1 - suf] == new[-1 - suf]:
        suf += 1
    # old[:lo] and old[hi:] are shared with new, so the same span of new ends at hi + shift.
    shift = len(new) - len(old)

    def widen(lo: int, hi: int) -> tuple[int, int]:
        while lo > 0 and not old[lo - 1].isspace():
            lo -= 1
        while hi < len(old) and not old[hi].isspace():
            hi += 1
        return lo, hi

    lo, hi = widen(pre, len(old) - suf)
    need = min(min_chars, len(old.strip()))
    while text.count(old[lo:hi]) != 1 or len(old[lo:hi].strip()) < need:
        if lo == 0 and hi == len(old):
            return old, new
        lo, hi = widen(max(lo - 1, 0), min(hi + 1, len(old)))
    return old[lo:hi], new[lo : hi + shift]


class MinimalEditOracle:
    """agent-env's oracle with each `edit` narrowed by `minimal_edit` (the same change), and
    in about ``detour_fraction`` of the tasks up to ``max_detours`` wrong edits of sibling
    tasks (`plan_detours`) sent before the task's first edit.

    Calls to the read-only tools in ``skip_tools`` are not played: `condense` would drop
    them and their observations from the transcript, and since they change nothing in the
    workspace, the episode without them gives every other observation unchanged. The
    visible tests' run costs a Python process in the sandbox: the demo's 800 transcripts,
    the same bytes, take 6.3 s without them and 23.1 s with them."""

    def __init__(
        self,
        tasks: Sequence[Task],
        min_chars: int = 10,
        detour_fraction: float = 0.0,
        max_detours: int = 2,
        skip_tools: Sequence[str] = (),
    ) -> None:
        self.oracle = OraclePolicy(tasks)
        self.min_chars = min_chars
        self.skip_tools = frozenset(skip_tools)
        self.detours: dict[str, list[Edit]] = plan_detours(
            tasks, detour_fraction, max_detours, self.narrow
        )
        self._scripts: dict[str, list[ToolCall]] = {}

    def for_task(self, task: Task) -> Callable[[list[dict[str, Any]]], Awaitable[ToolCall]]:
        """This policy for one episode of ``task`` (`run_episodes` binds it; tasks of a narrow
        family can share an instruction)."""

        async def policy(messages: list[dict[str, Any]]) -> ToolCall:
            script = self._script(task)
            done = sum(1 for m in messages if m.get("role") == "assistant")
            return script[min(done, len(script) - 1)]

        return policy

    async def __call__(self, messages: list[dict[str, Any]]) -> ToolCall:
        return await self.for_task(self.oracle.task_of(messages))(messages)

    def narrow(self, text: str, old: str, new: str) -> tuple[str, str]:
        return minimal_edit(text, old, new, self.min_chars)

    def _script(self, task: Task) -> list[ToolCall]:
        script = self._scripts.get(task.id)
        if script is None:
            script = [
                self._narrow(c, task) for c in oracle_script(task) if c.name not in self.skip_tools
            ]
            first_edit = next((i for i, c in enumerate(script) if c.name == "edit"), None)
            wrong = [_edit_call(path, old, new) for path, old, new in self.detours.get(task.id, [])]
            if first_edit is not None and wrong:
                script[first_edit:first_edit] = wrong
            self._scripts[task.id] = script
        return script

    def _narrow(self, call: ToolCall, task: Task) -> ToolCall:
        if call.name != "edit":
            return call
        args = json.loads(call.arguments)
        text = task.files.get(args["path"])
        if text is None:
            return call
        args["old_string"], args["new_string"] = self.narrow(
            text, args["old_string"], args["new_string"]
        )
        return msgspec.structs.replace(call, arguments=json.dumps(args))


def _edit_call(path: str, old: str, new: str) -> ToolCall:
    return ToolCall(
        name="edit", arguments=json.dumps({"path": path, "old_string": old, "new_string": new})
    )


async def _play(
    tasks: Sequence[Task], config: EnvConfig, concurrency: int, policy: MinimalEditOracle
) -> list[Trajectory]:
    return await run_episodes(policy, tasks, concurrency=concurrency, config=config)


def oracle_transcripts(
    tasks: Sequence[Task],
    config: EnvConfig,
    chat: AnyChatFormat,
    *,
    max_observation_chars: int,
    concurrency: int = 32,
    skip_tools: Sequence[str] = (),
    edit_min_chars: int = 10,
    max_turns: int | None = None,
    detour_fraction: float = 0.0,
    cache: str | Path | None = None,
    compaction: CompactionConfig | None = None,
    max_len: int = 0,
) -> list[tuple[list[int], list[int]]]:
    """Rendered transcripts of the oracle on ``tasks`` (only resolved episodes are kept).

    ``max_turns``: the policy's turn budget; transcripts are cut to it (`fit_turns`) and
    those that need more turns are left out.

    ``detour_fraction``: share of the tasks whose transcript first tries fixes of sibling
    tasks, reads the tool's error and then fixes the bug (`detours`); as many detours as the
    turn budget leaves room for (at most 2).

    ``cache``: a file to reuse between runs; it is keyed by the task ids and settings.

    ``compaction`` in ``summary`` mode (with the engine's window ``max_len``): a transcript
    is cut into the contexts a rollout would play it in, each ending with the oracle's
    summary (`summaries`); each context is one item.
    """
    summarise = compaction is not None and compaction.mode == "summary"
    # read_file and the fix take two turns; a closing submit past the budget is dropped
    room = 2 if max_turns is None else min(2, max_turns - 2)
    oracle = MinimalEditOracle(tasks, edit_min_chars, detour_fraction, room, skip_tools)
    key = msgspec.json.encode(
        {
            "tasks": [t.id for t in tasks],
            "turns": config.max_turns,
            "system": config.system_prompt,
            "obs": max_observation_chars,
            "skip": list(skip_tools),
            "format": chat.VERSION,
            "tools": tool_schemas(),
            "oracle": f"minimal-edit-{edit_min_chars}",
            "max_turns": max_turns,
            "detours": sorted(oracle.detours.items()),
            **(
                {"compaction": msgspec.to_builtins(compaction), "max_len": max_len}
                if summarise
                else {}
            ),
        }
    )
    path = Path(cache) if cache is not None else None
    if path is not None and path.is_file():
        stored = msgspec.json.decode(path.read_bytes())
        if stored.get("key") == key.decode():
            return [(ids, mask) for ids, mask in stored["items"]]
    trajectories = asyncio.run(_play(tasks, config, concurrency, oracle))
    kept = [t for t in trajectories if t.resolved]
    if len(kept) < len(trajectories):
        log.warning("midtrain.oracle_failures", failed=len(trajectories) - len(kept))
    played = [t.messages for t in kept]  # the oracle did not play the skipped calls
    if max_turns is not None:
        played = [m for m in (fit_turns(c, max_turns) for c in played) if m is not None]
        if len(played) < len(kept):
            log.warning("midtrain.transcripts_over_turn_budget", dropped=len(kept) - len(played))
    if summarise:
        assert compaction is not None
        cut = [
            compacted_transcript(
                chat, transcript_messages(m, max_observation_chars), compaction, max_len
            )
            for m in played
        ]
        if any(c is None for c in cut):
            log.warning("midtrain.transcripts_not_compactable", dropped=sum(c is None for c in cut))
        items = [item for c in cut if c is not None for item in c]
    else:
        items = [render_transcript(chat, m, max_observation_chars) for m in played]
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(msgspec.json.encode({"key": key.decode(), "items": items}))
    return items
