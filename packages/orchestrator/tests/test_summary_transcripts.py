"""Mid-training transcripts with summary turns are the contexts a rollout plays.

The independent computation: the rollout itself (`run_token_episode` with compaction), fed
the transcript's own assistant turns by a scripted engine against the real environment,
must produce the same contexts, token for token and with the same loss mask; the transcripts
are built by `compacted_transcript` over the oracle's messages, not by the rollout.
"""

from __future__ import annotations

import asyncio

import torch
from scripted_engine import ReplayEngine

from tandem.agent_env import EnvConfig, generate_multibug_tasks
from tandem.orchestrator.compaction_config import CompactionConfig
from tandem.orchestrator.inference.chat_format import ChatFormat
from tandem.orchestrator.midtrain.summaries import oracle_summary
from tandem.orchestrator.midtrain.transcripts import oracle_transcripts
from tandem.orchestrator.rollout.episode import run_token_episode

MAX_LEN = 2048
COMPACTION = CompactionConfig(mode="summary", trigger=0.6, summary_max_tokens=400)
ENV = EnvConfig(max_turns=16, partial_credit=True, system_prompt="Fix the bugs.")


def _sampled_turns(mask: list[int], ids: list[int]) -> list[list[int]]:
    turns, current = [], []
    for token, m in zip(ids, mask, strict=True):
        if m:
            current.append(token)
        elif current:
            turns, current = [*turns, current], []
    return [*turns, current] if current else turns


def test_summary_transcripts_are_the_contexts_a_rollout_plays() -> None:
    chat = ChatFormat()
    task = generate_multibug_tasks(5, 1, modules=4, buggy=3)[0]
    items = oracle_transcripts(
        [task], ENV, chat, max_observation_chars=400, max_turns=16,
        compaction=COMPACTION, max_len=MAX_LEN,
    )  # fmt: skip
    assert len(items) >= 3  # the oracle's episode needed at least two summaries
    assert all(len(ids) <= MAX_LEN for ids, _ in items)
    instruction = chat.tok.encode(COMPACTION.instruction)
    for ids, mask in items[:-1]:  # every context but the last ends with the summary
        turn = _sampled_turns(mask, ids)[-1]
        text = chat.tok.decode(turn[:-1], keep_special=False)
        assert text.startswith("Fixed: ") and turn[-1] == chat.end_id
        at = len(ids) - len(turn) - 1  # the header before the summary
        assert ids[at - 1 - len(instruction) : at - 1] == instruction
    # The rollout, given the same sampled turns, plays the same contexts.
    turns = [t for ids, mask in items for t in _sampled_turns(mask, ids)]
    sample = asyncio.run(
        run_token_episode(
            ReplayEngine(turns, MAX_LEN), chat, task, ENV, max_new_tokens=COMPACTION.summary_max_tokens,
            max_observation_chars=400, generator=torch.Generator(), compaction=COMPACTION,
        )
    )  # fmt: skip
    segments = sample.segments()
    assert len(segments) == len(items)
    for seg, (ids, mask) in zip(segments, items, strict=True):
        assert seg.tokens == ids
        assert seg.loss_mask == mask
    assert sample.resolved and sample.reward == 1.0


def test_the_oracle_summary_names_each_fix_and_file_read() -> None:
    call = lambda i, name, args: {  # noqa: E731
        "role": "assistant",
        "tool_calls": [{"id": i, "function": {"name": name, "arguments": args}}],
    }
    messages = [
        call("1", "read_file", '{"path": "a.py"}'),
        {"role": "tool", "tool_call_id": "1", "content": "1\tx = 1"},
        call("2", "edit", '{"path": "a.py", "old_string": "x = 1", "new_string": "x = 2"}'),
        {"role": "tool", "tool_call_id": "2", "content": "edited a.py"},
        call("3", "edit", '{"path": "b.py", "old_string": "y", "new_string": "z"}'),
        {"role": "tool", "tool_call_id": "3", "content": "error: old_string not found"},
    ]
    assert oracle_summary(messages) == "Fixed: a.py: `x = 1` -> `x = 2`.\nRead: a.py."
    assert oracle_summary(messages[:2]) == "Fixed: nothing yet.\nRead: a.py."
