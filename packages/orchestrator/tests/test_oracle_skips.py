"""The oracle does not play the read-only calls its transcripts leave out, and the
transcripts are the bytes of the episodes that played them."""

from __future__ import annotations

import asyncio

import pytest

from tandem.agent_env import EnvConfig, generate_multibug_tasks, generate_tasks, run_episodes
from tandem.orchestrator.config import ConfigValueError, MidtrainConfig
from tandem.orchestrator.midtrain.transcripts import (
    MinimalEditOracle,
    condense,
    fit_turns,
    oracle_transcripts,
    render_transcript,
)

SKIP = ["list_dir", "run_tests"]


def _played_then_condensed(chat, tasks, env: EnvConfig, max_turns: int) -> list[tuple]:
    """The reference: every call of the oracle's script played, the skipped ones then cut
    from the messages (what the transcripts were made from before)."""
    oracle = MinimalEditOracle(tasks, 4)
    played = asyncio.run(run_episodes(oracle, tasks, concurrency=8, config=env))
    assert all(t.resolved for t in played)
    calls = [
        c["function"]["name"] for t in played for m in t.messages for c in m.get("tool_calls") or []
    ]
    assert set(SKIP) <= set(calls)  # the reference does play them
    fitted = [fit_turns(condense(t.messages, SKIP), max_turns) for t in played]
    return [render_transcript(chat, m, 600) for m in fitted if m is not None]


@pytest.mark.parametrize("family", ["demo", "multibug"])
def test_transcripts_without_the_skipped_calls_are_the_same_bytes(chat, family) -> None:
    if family == "demo":
        tasks = generate_tasks(
            11, 10, kinds=["wrong_operator", "off_by_one", "swapped_arguments"],
            functions=["gcd", "chunked", "digit_sum"], modules=["toolbelt"], functions_per_repo=1,
        )  # fmt: skip
        max_turns = 3
    else:  # run_tests comes before the files are read
        tasks = generate_multibug_tasks(3, 2, modules=4, buggy=3)
        max_turns = 12
    env = EnvConfig(max_turns=12, partial_credit=family == "multibug", system_prompt="Fix it.")
    items = oracle_transcripts(
        tasks, env, chat, max_observation_chars=600, skip_tools=SKIP, edit_min_chars=4,
        max_turns=max_turns,
    )  # fmt: skip
    assert len(items) == len(tasks)
    assert items == _played_then_condensed(chat, tasks, env, max_turns)
    scripts = MinimalEditOracle(tasks, 4, skip_tools=SKIP)
    for task in tasks:
        names = [c.name for c in scripts._script(task)]
        assert not set(SKIP) & set(names) and names[-1] == "submit"


def test_a_tool_that_changes_the_workspace_cannot_be_skipped() -> None:
    with pytest.raises(ConfigValueError, match=r"skip_tools: \['edit'\] change the workspace"):
        MidtrainConfig(skip_tools=["list_dir", "edit"])
