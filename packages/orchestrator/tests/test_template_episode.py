"""An episode in a checkpoint's own chat format, played against the real environment by an
engine that writes scripted turns.

The prompt lists the environment's tools in the template's ``# Tools`` block; each
``<tool_call>`` turn reaches the environment as the call it spells; the episode's token
stream is the whole conversation rendered at once (the independent computation: the template
over the trajectory's messages); and a turn sampled as ids the tokenizer would never produce
(one id per character) stays exactly those ids in the stream the trainer scores.

Each test runs with a Qwen3-style template and with SmolLM2's ChatML template, which has no
tool syntax (the tools listed in the system message, calls and results in plain turns:
`tool_prompt`).
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from scripted_engine import ReplayEngine

from tandem.agent_env import EnvConfig, generate_tasks, tool_schemas
from tandem.orchestrator.inference import tool_prompt
from tandem.orchestrator.inference.template_chat import TemplateChatFormat
from tandem.orchestrator.rollout.episode import run_token_episode
from tandem.orchestrator.wire import Sample


def _turn(chat: TemplateChatFormat, text: str) -> list[int]:
    """A sampled turn: the tokenizer's ids of ``text``, then the end-of-turn id."""
    return [*chat.tok.encode(text), chat.end_id]


def _call_text(chat: TemplateChatFormat, name: str, **arguments: object) -> str:
    """A call as the template writes it: Qwen3's on lines of their own, the fallback's inline."""
    if not chat.speaks_tools:
        return tool_prompt.call_text({"name": name, "arguments": arguments})
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


def _play(chat: TemplateChatFormat, turns: list[list[int]]) -> tuple[Sample, ReplayEngine]:
    engine = ReplayEngine(turns)
    task = generate_tasks(seed=0, n=1)[0]
    config = EnvConfig(max_turns=3, allow_unsandboxed=True, system_prompt="Fix the bug.")
    sample = asyncio.run(
        run_token_episode(
            engine,
            chat,
            task,
            config,
            max_new_tokens=512,
            max_observation_chars=100_000,
            generator=torch.Generator().manual_seed(0),
        )
    )
    return sample, engine


def _assistant_spans(mask: list[int]) -> list[tuple[int, int]]:
    spans, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


@pytest.fixture(scope="module", params=["template", "smollm2"])
def chat(request: pytest.FixtureRequest) -> TemplateChatFormat:
    return TemplateChatFormat(request.getfixturevalue(f"{request.param}_tokenizer_dir"))


def test_a_template_episode_is_the_whole_conversation(chat: TemplateChatFormat) -> None:
    texts = [
        "Let me look around." + "\n" + _call_text(chat, "list_dir", path="."),
        _call_text(chat, "submit"),
    ]
    turns = [_turn(chat, t) for t in texts]
    sample, engine = _play(chat, turns)

    prompt = chat.tok.decode(engine.feeds[0])
    assert "# Tools" in prompt
    if chat.speaks_tools:
        for schema in tool_schemas():
            assert json.dumps(schema, ensure_ascii=False) in prompt
    else:
        listing = tool_prompt.describe_tools(tool_schemas())
        assert f"\n\n{listing}<|im_end|>\n<|im_start|>user\n" in prompt  # the system turn's end

    # each call reached the environment as written: list_dir answered, submit ended it
    calls = [m["tool_calls"][0]["function"] for m in sample.messages if m["role"] == "assistant"]
    assert [c["name"] for c in calls] == ["list_dir", "submit"]
    assert json.loads(calls[0]["arguments"]) == {"path": "."}
    assert sample.format_errors == 0 and sample.turns == 2
    listing = next(m["content"] for m in sample.messages if m["role"] == "tool")
    assert "error" not in listing.lower() and listing.strip()

    # the stream ends with the last sampled turn: the environment's answer to the final
    # call is never fed
    assert sample.messages[-1]["role"] == "tool"
    whole, mask = chat.render(sample.messages[:-1], tools=tool_schemas())
    assert sample.tokens == whole
    assert sample.loss_mask == mask
    spans = _assistant_spans(sample.loss_mask)
    assert [sample.tokens[i:j] for i, j in spans] == turns


def test_sampled_ids_are_never_retokenized(chat: TemplateChatFormat) -> None:
    """A turn sampled one character per id parses to the same call, and the trainer's
    stream keeps those ids (a re-rendering would give the tokenizer's own, fewer ids)."""
    text = _call_text(chat, "list_dir", path=".")
    odd = [*(i for ch in text for i in chat.tok.encode(ch)), chat.end_id]
    canonical = _turn(chat, text)
    assert odd != canonical and chat.tok.decode(odd) == chat.tok.decode(canonical)
    turns = [odd, _turn(chat, _call_text(chat, "submit"))]
    sample, _ = _play(chat, turns)

    spans = _assistant_spans(sample.loss_mask)
    assert sample.tokens[spans[0][0] : spans[0][1]] == odd
    assert sample.format_errors == 0
    whole, _ = chat.render(sample.messages[:-1], tools=tool_schemas())
    assert len(whole) == len(sample.tokens) - (len(odd) - len(canonical))


def test_a_malformed_turn_costs_the_turn_with_a_reason(chat: TemplateChatFormat) -> None:
    turns = [
        _turn(chat, '<tool_call>\n{"name": "list_dir", "arguments": \n</tool_call>'),
        _turn(chat, _call_text(chat, "submit")),
    ]
    sample, engine = _play(chat, turns)
    assert sample.format_errors == 1 and sample.turns == 2
    assert sample.tool_errors == 1  # a malformed call is also a call the env answered in error
    observation = chat.tok.decode(engine.feeds[1])
    assert "<tool_response>\nerror: the tool call is not valid JSON" in observation
    spans = _assistant_spans(sample.loss_mask)
    assert [sample.tokens[i:j] for i, j in spans] == turns


def test_an_edit_the_file_does_not_match_counts_as_a_tool_error(chat: TemplateChatFormat) -> None:
    task = generate_tasks(seed=0, n=1)[0]
    path = task.reference_edits[0].path
    turns = [
        _turn(chat, _call_text(chat, "edit", path=path, old_string="no such text", new_string="x")),
        _turn(chat, _call_text(chat, "read_file", path=path)),
        _turn(chat, _call_text(chat, "submit")),
    ]
    sample, _ = _play(chat, turns)
    assert sample.format_errors == 0 and sample.turns == 3
    assert sample.tool_errors == 1
    assert "not found" in next(m["content"] for m in sample.messages if m["role"] == "tool")
