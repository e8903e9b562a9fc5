"""Oracle transcripts longer than the window, cut into contexts the way a rollout cuts them.

A long oracle episode does not fit the engine's window, and in RL such an episode is
compacted (`rollout.compaction`): at the trigger the policy is asked to summarise, and the
episode goes on from the system prompt, the task, the summary and the last tool output. For
the mid-trained policy to summarise before RL (the seed's order: mid-training, then RL),
its transcripts hold the same turns: each context ends with the instruction and a summary
the oracle writes from what it has done (the fixes so far, the files read), and the next
context starts as a rollout's would. Each context is one training sequence.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from tandem.agent_env import tool_schemas
from tandem.orchestrator.compaction_config import CompactionConfig
from tandem.orchestrator.inference.formats import AnyChatFormat
from tandem.orchestrator.rollout.compaction import summary_messages

Rendered = tuple[list[int], list[int]]


def oracle_summary(messages: Sequence[dict[str, Any]]) -> str:
    """What the episode has done so far, as the oracle would summarise it: each edit that
    applied (path, the text replaced and its replacement) and the files read."""
    calls: dict[str, dict[str, Any]] = {}
    fixes: list[str] = []
    read: list[str] = []
    for m in messages:
        for call in m.get("tool_calls") or []:
            calls[call["id"]] = call["function"]
        fn = calls.get(m.get("tool_call_id") or "")
        if m.get("role") != "tool" or fn is None or m.get("content", "").startswith("error"):
            continue
        args = json.loads(fn["arguments"]) if isinstance(fn["arguments"], str) else fn["arguments"]
        if fn["name"] == "edit":
            fixes.append(f"{args['path']}: `{args['old_string']}` -> `{args['new_string']}`")
        elif fn["name"] == "read_file" and args.get("path") not in read:
            read.append(str(args.get("path")))
    lines = [f"Fixed: {'; '.join(fixes)}." if fixes else "Fixed: nothing yet."]
    if read:
        lines.append(f"Read: {', '.join(read)}.")
    return "\n".join(lines)


def compacted_transcript(
    chat: AnyChatFormat,
    messages: Sequence[dict[str, Any]],
    compaction: CompactionConfig,
    max_len: int,
) -> list[Rendered] | None:
    """The contexts (ids, loss_mask) a rollout in ``compaction``'s ``summary`` mode would
    have played ``messages`` (an oracle episode: system, task, then calls and their outputs,
    observations already truncated) in, each ending with the oracle's summary; or None
    where the episode cannot be played so (a fresh context that does not shrink).

    The trigger is checked as the rollout does: before each tool output is added."""
    tools = tool_schemas()
    trigger = compaction.trigger_tokens(max_len)
    opening = [dict(m) for m in messages[:2]]
    ask = {"role": "user", "content": compaction.instruction}
    out: list[Rendered] = []
    context = list(opening)
    done: list[dict[str, Any]] = []  # every message so far, across contexts
    rest = list(messages[2:])
    while rest:
        call = rest.pop(0)
        context.append(call)
        done.append(call)
        if not rest:
            break
        output = rest.pop(0)
        done.append(output)
        grown, _ = chat.render([*context, output], add_generation_prompt=True, tools=tools)
        if len(grown) < trigger:
            context.append(output)
            continue
        asked, _ = chat.render([*context, output, ask], add_generation_prompt=True, tools=tools)
        unseen = len(asked) + compaction.summary_max_tokens > max_len
        summary = oracle_summary(done if not unseen else done[:-1])
        seen = [] if unseen else [output]
        out.append(chat.render([*context, *seen, ask, {"role": "assistant", "content": summary}],
                               tools=tools))  # fmt: skip
        last = output["content"] if compaction.keep_last_observation or unseen else None
        context = summary_messages(opening, summary, last)
        prompt, _ = chat.render(context, add_generation_prompt=True, tools=tools)
        if len(prompt) >= trigger:
            return None
    out.append(chat.render(context, tools=tools))
    return out
