"""Long episodes: a full context is summarised (or slides) and the episode goes on in a fresh
one; every context is one training segment.

A scripted engine (the `Engine` protocol, byte chat format) plays exact turns against the
real environment, so each test knows what every context must hold; the last tests play the
real embedded engine with a random policy and check each segment against the trainer's own
forward, bit for bit with routes replayed.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

import msgspec
import numpy as np
import pytest
import torch

from tandem.agent_env import EnvConfig, generate_tasks
from tandem.moe_determinism import batch_invariant
from tandem.orchestrator.compaction_config import DEFAULT_INSTRUCTION, CompactionConfig
from tandem.orchestrator.config import ConfigValueError, RunConfig, TrainerConfig
from tandem.orchestrator.eval.passk import summarize
from tandem.orchestrator.inference.chat_format import ChatFormat, ToolCall
from tandem.orchestrator.inference.embedded.server import EngineServer
from tandem.orchestrator.rollout.compaction import (
    LAST_OUTPUT_HEADER,
    SUMMARY_HEADER,
    check_prompts,
    truncate_observation,
)
from tandem.orchestrator.rollout.episode import episode_generator, run_token_episode
from tandem.orchestrator.training.collate import collate
from tandem.orchestrator.training.scoring import score
from tandem.orchestrator.training.trainer import RLTrainer
from tandem.orchestrator.wire import (
    Sample,
    Segment,
    TurnOutput,
    compaction_figures,
    decode,
    encode,
)

TASK = generate_tasks(seed=0, n=1)[0]
FILE = next(iter(TASK.files))


class ScriptedEngine:
    """The `Engine` protocol: each tool turn is the next scripted call; a turn asked for
    after the summary instruction is ``summary`` (cut at the budget, as an engine cuts)."""

    def __init__(self, chat: ChatFormat, calls: list[ToolCall], summary: str, max_len: int):
        self.chat, self.calls, self.summary, self._max_len = chat, list(calls), summary, max_len
        self.feeds: list[list[int]] = []
        self.held: set[int] = set()
        self.most_held = 0
        self.acquired = 0
        self.version = 0

    @property
    def max_len(self) -> int:
        return self._max_len

    async def acquire(self) -> int:
        self.acquired += 1
        self.held.add(self.acquired)
        self.most_held = max(self.most_held, len(self.held))
        return self.acquired

    def release(self, slot: int) -> None:
        self.held.remove(slot)

    async def generate(
        self,
        slot: int,
        feed: list[int],
        generator: torch.Generator,
        max_new_tokens: int,
        keep_going: Callable[[int], bool] | None = None,
    ) -> TurnOutput:
        assert slot in self.held
        self.feeds.append(list(feed))
        asked = DEFAULT_INSTRUCTION in self.chat.tok.decode(feed, keep_special=False)
        if asked:
            body = self.chat.tok.encode(self.summary)
        else:
            body = self.chat.render_tool_call(self.calls.pop(0))
        tokens = [*body, self.chat.end_id][:max_new_tokens]
        self.version += 1  # every turn on newer weights: versions must survive the segments
        fed = len(feed) + len(tokens) - 1
        return TurnOutput(
            tokens=tokens,
            logprobs=[-0.25] * len(tokens),
            versions=[self.version] * len(tokens),
            routes=np.full((fed, 1, 1), self.version, dtype=np.int16),
            min_version=self.version,
            max_version=self.version,
            truncated=len(body) + 1 > max_new_tokens,
        )


def _play(engine: ScriptedEngine, compaction: CompactionConfig, max_turns: int = 8) -> Sample:
    env = EnvConfig(max_turns=max_turns, allow_unsandboxed=True, system_prompt="Fix the bug.")
    return asyncio.run(
        run_token_episode(
            engine,
            engine.chat,
            TASK,
            env,
            max_new_tokens=128,
            max_observation_chars=300,
            generator=torch.Generator().manual_seed(0),
            compaction=compaction,
        )
    )


READ = ToolCall(name="read_file", arguments={"path": FILE})
SUBMIT = ToolCall(name="submit", arguments={})


def _text(chat: ChatFormat, ids: list[int]) -> str:
    return chat.tok.decode(ids, keep_special=False)


def _first_sampled(segment: Segment) -> int:
    """Where a segment's prompt ends (its first sampled token)."""
    return next(i for i, v in enumerate(segment.versions) if v >= 0)


def test_a_full_context_is_summarised_and_the_episode_goes_on() -> None:
    chat = ChatFormat()
    engine = ScriptedEngine(chat, [READ] * 6 + [SUBMIT], "found the bug in line 7", 2048)
    sample = _play(engine, CompactionConfig(mode="summary", trigger=0.6))
    segments = sample.segments()
    assert len(segments) >= 2 and len(sample.compactions) == len(segments) - 1
    assert sample.termination == "submitted" and sample.turns == 7
    assert engine.most_held == 1 and not engine.held  # each old slot released before the next
    assert engine.acquired == len(segments)
    trigger = int(0.6 * 2048)
    for seg, record in zip(segments, sample.compactions, strict=False):
        # the segment ends with the summary, sampled after the instruction and in the loss
        text = _text(chat, seg.tokens)
        assert text.endswith("found the bug in line 7") and DEFAULT_INSTRUCTION in text
        summary = [*chat.tok.encode("found the bug in line 7"), chat.end_id]
        assert seg.tokens[-len(summary) :] == summary and all(seg.loss_mask[-len(summary) :])
        assert record.summary == len(summary) and not record.cut
        assert record.replaced >= trigger and record.kept < trigger
        assert seg.routes.shape[0] == len(seg.tokens) - 1
    output = next(m["content"] for m in sample.messages if m["role"] == "tool")
    for before, after in itertools.pairwise(segments):
        # the next context: system prompt, task, summary and last output, nothing else
        prompt = _text(chat, after.tokens[: _first_sampled(after)])
        assert prompt.startswith("Fix the bug.") and TASK.instruction in prompt
        assert f"{SUMMARY_HEADER}\nfound the bug in line 7" in prompt
        assert f"{LAST_OUTPUT_HEADER}\n{truncate_observation(output, 300)}" in prompt
        assert DEFAULT_INSTRUCTION not in prompt
        # versions and routes of each segment are its own turns', in order
        assert max(before.versions) < min(v for v in after.versions if v >= 0)
        assert before.max_version < after.min_version
    assert sample.min_version == segments[0].min_version
    assert sample.max_version == segments[-1].max_version
    assert decode(encode(sample), Sample).segments()[0].tokens == segments[0].tokens


def test_an_untrained_summary_is_masked_out_of_the_loss() -> None:
    chat = ChatFormat()
    engine = ScriptedEngine(chat, [READ] * 6 + [SUBMIT], "notes", 2048)
    sample = _play(engine, CompactionConfig(mode="summary", trigger=0.6, train_summary=False))
    first = sample.segments()[0]
    n = len(chat.tok.encode("notes")) + 1
    assert first.tokens[-n:] == [*chat.tok.encode("notes"), chat.end_id]
    assert not any(first.loss_mask[-n:]) and any(first.loss_mask)  # the tool calls still are


def test_a_summary_past_its_limit_is_cut_and_an_empty_one_goes_on() -> None:
    chat = ChatFormat()
    long = ScriptedEngine(chat, [READ] * 6 + [SUBMIT], "x" * 500, 2048)
    sample = _play(long, CompactionConfig(mode="summary", trigger=0.6, summary_max_tokens=40))
    assert sample.compactions and all(c.cut and c.summary == 40 for c in sample.compactions)
    assert sample.termination == "submitted"
    empty = ScriptedEngine(chat, [READ] * 6 + [SUBMIT], "", 2048)
    sample = _play(empty, CompactionConfig(mode="summary", trigger=0.6))
    assert sample.compactions and sample.compactions[0].summary == 1  # the end-of-turn alone
    assert sample.termination == "submitted"


def test_a_summary_that_does_not_shrink_the_context_ends_the_episode() -> None:
    chat = ChatFormat()
    engine = ScriptedEngine(chat, [READ] * 6 + [SUBMIT], "y" * 590, 2048)
    sample = _play(engine, CompactionConfig(mode="summary", trigger=0.4, summary_max_tokens=600))
    assert sample.termination == "summary_too_long" and sample.reward == 0.0
    assert len(sample.compactions) == 1 and len(sample.segments()) == 1
    assert not engine.held


def test_the_sliding_window_keeps_the_prompt_and_the_latest_turns() -> None:
    chat = ChatFormat()
    engine = ScriptedEngine(chat, [READ] * 6 + [SUBMIT], "", 2048)
    sample = _play(engine, CompactionConfig(mode="sliding", trigger=0.6, keep_fraction=0.4))
    segments = sample.segments()
    assert len(segments) >= 2 and sample.termination == "submitted"
    first_prompt = engine.feeds[0]
    header = chat.header("assistant")
    output = next(m["content"] for m in sample.messages if m["role"] == "tool")
    for before, after in itertools.pairwise(segments):
        prompt = after.tokens[: _first_sampled(after)]
        assert prompt[: len(first_prompt) - 1] == first_prompt[:-1]
        assert len(prompt) <= int(0.4 * 2048)
        # it ends with the newest whole turn: the last call, as sampled, and its output
        call = before.tokens[len(before.tokens) - before.loss_mask[::-1].index(0) :]
        assert call == [*chat.render_tool_call(READ), chat.end_id]
        at = max(i for i in range(len(prompt)) if prompt[i : i + len(call)] == call)
        assert prompt[at - len(header) : at] == header
        seen = truncate_observation(output, 300)
        assert (
            prompt[at + len(call) :]
            == chat.render_turn({"role": "tool", "content": seen})[0] + header
        )
    assert all(c.summary == 0 for c in sample.compactions)


def test_without_compaction_a_full_context_ends_the_episode() -> None:
    chat = ChatFormat()
    engine = ScriptedEngine(chat, [READ] * 6 + [SUBMIT], "", 2048)
    sample = _play(engine, CompactionConfig())
    assert sample.termination == "context_limit" and sample.reward == 0.0
    assert len(sample.segments()) == 1 and not sample.compactions


@pytest.mark.parametrize(
    "compaction",
    [CompactionConfig(), CompactionConfig(mode="sliding", trigger=0.9, keep_fraction=0.5)],
    ids=["none", "sliding"],
)
def test_a_prompt_that_alone_fills_the_window_is_refused(compaction: CompactionConfig) -> None:
    """At start, for the tasks a run checks (`check_prompts`), and by the episode itself."""
    chat = ChatFormat()
    env = EnvConfig(allow_unsandboxed=True, system_prompt="Fix the bug.")
    fits = generate_tasks(seed=0, n=4)
    check_prompts(chat, fits, env, 2048, compaction)
    with pytest.raises(ConfigValueError, match=rf"^tasks: the prompt of task {TASK.id} alone"):
        check_prompts(chat, fits, env, 300, compaction)
    engine = ScriptedEngine(chat, [SUBMIT], "", 300)
    with pytest.raises(ValueError, match=rf"task {TASK.id}: its prompt alone is \d+ tokens"):
        _play(engine, compaction)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"trigger": 1.0}, "trigger"),
        ({"trigger": 1.5}, "trigger"),
        ({"summary_max_tokens": 0}, "summary_max_tokens"),
    ],
)
def test_bad_limits_are_one_line(overrides: dict, field: str) -> None:
    with pytest.raises(ConfigValueError, match=f"^{field}: "):
        CompactionConfig(mode="summary", **overrides)


@pytest.mark.parametrize(
    ("compaction", "field"),
    [
        ({"summary_max_tokens": 2048}, "episode.compaction.summary_max_tokens"),
        ({"trigger": 0.95, "summary_max_tokens": 256}, "episode.compaction.trigger"),
    ],
)
def test_limits_against_the_window_are_checked_at_start(compaction: dict, field: str) -> None:
    raw = {
        "engine": {"max_len": 2048},
        "episode": {"compaction": {"mode": "summary", **compaction}},
    }
    with pytest.raises(msgspec.ValidationError, match=f"^{field}: ") as info:
        msgspec.convert(raw, RunConfig)
    assert "\n" not in str(info.value)


def _play_real(policy, make_engine, compaction: CompactionConfig, n: int) -> list[Sample]:
    chat = ChatFormat()
    engine = make_engine(policy, max_len=1024, max_new_tokens=24)
    env = EnvConfig(max_turns=12, allow_unsandboxed=True, system_prompt="Fix it.")
    task = generate_tasks(seed=3, n=1, functions=["gcd"], functions_per_repo=1)[0]

    async def go() -> list[Sample]:
        server = EngineServer(engine)
        serve = asyncio.create_task(server.serve())
        try:
            return list(
                await asyncio.gather(
                    *(
                        run_token_episode(
                            server, chat, task, env, max_new_tokens=24,
                            max_observation_chars=120, generator=episode_generator(5, j),
                            compaction=compaction,
                        )
                        for j in range(n)
                    )
                )
            )  # fmt: skip
        finally:
            server.close()
            await asyncio.gather(serve, return_exceptions=True)

    samples = asyncio.run(go())
    assert engine.free_slots == engine.config.max_slots  # every context's slot released
    return samples


def test_every_segment_scores_the_engines_bits_with_routes_replayed(
    tiny_policy, make_engine
) -> None:
    compaction = CompactionConfig(
        mode="summary", trigger=0.5, summary_max_tokens=32, instruction="Summarise.",
        keep_last_observation=False,
    )  # fmt: skip
    samples = _play_real(tiny_policy, make_engine, compaction, 4)
    assert sum(len(s.compactions) for s in samples) >= 4  # a random policy fills its window
    for s in samples[::2]:  # a random policy fixes nothing: give each group a signal
        s.reward = 1.0
    batch = collate([samples[:2], samples[2:]])
    assert batch.episode_ids is not None
    assert batch.num_sequences == sum(len(s.segments()) for s in samples)
    with torch.no_grad(), batch_invariant():
        replayed, _, _ = score(tiny_policy, batch, "R3")
    mask = batch.loss_mask
    assert int(mask.sum()) > 100
    assert torch.equal(
        replayed[mask].view(torch.int32), batch.rollout_logprobs[mask].view(torch.int32)
    )
    # each row's reward and group are its episode's
    for row, episode in enumerate(batch.episode_ids.tolist()):
        assert float(batch.rewards[row]) == samples[episode].reward
        assert int(batch.group_ids[row]) == episode // 2
    # the trainer's step over the segment rows: zero mismatch, every route replayed
    trainer = RLTrainer(tiny_policy, TrainerConfig(lr=1e-3, routing_check_rows=4))
    metrics = trainer.step([samples[:2], samples[2:]], 0)
    assert metrics["step_applied"] == 1.0 and metrics["mismatch_tokens"] > 100
    assert metrics["mismatch_max_abs"] == 0.0 and metrics["routing_agreement_replay"] == 1.0


def test_the_figures_of_compacted_episodes() -> None:
    """Per-episode compactions, summary length against the context replaced, cut share: as
    `compaction_figures` and the evaluation's summary give them, against a count by hand."""
    chat = ChatFormat()
    cut = _play(
        ScriptedEngine(chat, [READ] * 6 + [SUBMIT], "x" * 500, 2048),
        CompactionConfig(mode="summary", trigger=0.6, summary_max_tokens=40),
    )
    whole = _play(ScriptedEngine(chat, [SUBMIT], "", 2048), CompactionConfig(mode="summary"))
    records = cut.compactions
    assert records and not whole.compactions
    figures = compaction_figures([cut, whole])
    assert figures["compactions"] == len(records) / 2
    assert figures["summary_tokens"] == 40 and figures["summaries_cut"] == 1.0
    assert figures["replaced_tokens"] == sum(c.replaced for c in records) / len(records)
    result = summarize([[cut], [whole]], ks=(1,))
    assert result.compaction == figures
    assert result.terminations == {"submitted": 2}


def test_a_window_that_would_slide_again_at_once_is_refused() -> None:
    with pytest.raises(ConfigValueError, match=r"^keep_fraction: 0.7 must be above 0 and below"):
        CompactionConfig(mode="sliding", trigger=0.6, keep_fraction=0.7)
    CompactionConfig(mode="summary", trigger=0.4)  # the window's share matters to sliding only
