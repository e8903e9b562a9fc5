"""Pieces around episodes: tool-call conversion, observation truncation, transcripts, pass@k."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch

from tandem.agent_env import generate_tasks
from tandem.orchestrator.config import ConfigValueError, RLConfig, TaskConfig
from tandem.orchestrator.eval.passk import pass_at_k
from tandem.orchestrator.midtrain.transcripts import (
    condense,
    fit_turns,
    minimal_edit,
    render_transcript,
)
from tandem.orchestrator.rollout.episode import (
    FORMAT_ERROR_TOOL,
    Sample,
    episode_generator,
    to_env_call,
    truncate_observation,
)
from tandem.orchestrator.training.collate import collate


def test_generated_call_becomes_agent_env_call(chat) -> None:
    turn = [
        *chat.tok.encode("look first"),
        chat.call_open,
        *chat.tok.encode('read_file {"path": "a.py"}'),
        chat.call_close,
        chat.end_id,
    ]
    call, error = to_env_call(chat, turn)
    assert error is None
    assert call.name == "read_file" and json.loads(call.arguments) == {"path": "a.py"}
    assert call.content == "look first"


def test_unparsable_output_becomes_a_format_error(chat) -> None:
    call, error = to_env_call(chat, [*chat.tok.encode("just text"), chat.end_id])
    assert call.name == FORMAT_ERROR_TOOL
    assert error is not None and "no tool call" in error


def test_truncation_keeps_both_ends_and_bounds_length() -> None:
    text = "HEAD" + "x" * 5000 + "TAIL"
    out = truncate_observation(text, 300)
    assert out.startswith("HEAD") and out.endswith("TAIL") and len(out) <= 340
    assert truncate_observation("short", 300) == "short"


def test_episode_rng_depends_only_on_its_keys() -> None:
    a = torch.rand(4, generator=episode_generator(1, 2, 3))
    b = torch.rand(4, generator=episode_generator(1, 2, 3))
    c = torch.rand(4, generator=episode_generator(1, 3, 2))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_pass_at_k_matches_enumeration() -> None:
    for n, c, k in [(5, 2, 1), (5, 2, 3), (6, 0, 2), (4, 4, 2), (7, 3, 4)]:
        subsets = list(itertools.combinations([1] * c + [0] * (n - c), k))
        brute = sum(any(s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(brute)


def _messages() -> list[dict]:
    def call(i: int, name: str, args: dict) -> dict:
        fn = {"name": name, "arguments": json.dumps(args)}
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": f"c{i}", "function": fn}],
        }

    return [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "fix"},
        call(0, "list_dir", {"path": "."}),
        {"role": "tool", "tool_call_id": "c0", "content": "a.py"},
        call(1, "read_file", {"path": "a.py"}),
        {"role": "tool", "tool_call_id": "c1", "content": "1\tx = 1"},
        call(2, "submit", {}),
        {"role": "tool", "tool_call_id": "c2", "content": "submitted"},
    ]


def test_condensed_transcript_matches_a_shorter_episode(chat) -> None:
    msgs = _messages()
    condensed = condense(msgs, ["list_dir"])
    assert [m["role"] for m in condensed] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
    ]
    ids, mask = render_transcript(chat, msgs, 600, ["list_dir"])
    expected, expected_mask = chat.render(condensed[:-1])  # nothing after the final call
    assert ids == expected and mask == expected_mask
    assert ids[-1] == chat.end_id and mask[-1] == 1


def test_transcripts_fit_the_turn_budget() -> None:
    msgs = condense(_messages(), ["list_dir"])  # read_file, submit
    assert fit_turns(msgs, 2) == msgs
    # the closing submit beyond the budget is dropped: the env grades at the limit anyway
    cut = fit_turns(msgs, 1)
    assert cut is not None and [m["role"] for m in cut] == ["system", "user", "assistant", "tool"]
    # a budget that ends before a call which changes the outcome: no transcript
    assert fit_turns(_messages(), 1) is None
    assert fit_turns(msgs, 0) is None


def test_collate_pads_and_aligns(chat) -> None:
    def sample(n: int, reward: float) -> Sample:
        return Sample(
            task_id="t",
            tokens=list(range(n)),
            loss_mask=[0] * 3 + [1] * (n - 3),
            logprobs=[0.0] * 3 + [-0.5] * (n - 3),
            versions=[-1] * 3 + [2] * (n - 3),
            routes=np.ones((n - 1, 2, 2), dtype=np.uint8),
            reward=reward,
            resolved=reward > 0,
            turns=1,
            termination="submitted",
            min_version=2,
            max_version=2,
        )

    batch = collate([[sample(6, 1.0), sample(9, 0.0)]])
    batch.validate()
    assert batch.input_ids.shape == (2, 9) and batch.extras["routes"].shape == (2, 8, 2, 2)
    assert batch.attention_mask[0].tolist() == [True] * 6 + [False] * 3
    assert not bool(batch.loss_mask[:, 0].any())
    assert int(batch.extras["routes"][0, 5:].sum()) == 0


def test_bad_rl_config_names_the_field() -> None:
    with pytest.raises(ConfigValueError, match="group_size"):
        RLConfig(group_size=1)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"functions": ["gcd", "nope"]}, "functions: unknown"),
        ({"functions": ["gcd"], "functions_per_repo": 2}, "functions_per_repo"),
        ({"modules": ["a b"]}, "modules"),
        ({"family": "multibug", "buggy_modules": 2}, "buggy_modules"),
        ({"family": "multibug", "repo_modules": 30}, "repo_modules"),
        ({"family": "multibug", "functions_per_repo": 0}, "functions_per_repo"),
        ({"family": "multibug", "functions": ["gcd"]}, "functions"),
        ({"family": "multibug", "kinds": ["no_such_kind"]}, "kinds"),
    ],
)
def test_bad_task_family_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigValueError, match=field):
        TaskConfig(**kwargs)


def test_task_source_draws_from_the_configured_family() -> None:
    from tandem.orchestrator.rollout.tasks import TaskSource

    config = TaskConfig(functions=["gcd", "digit_sum"], modules=["numkit"])
    tasks = TaskSource(config, seed=4).take(0, 8)
    assert {t.metadata["function"] for t in tasks} <= {"gcd", "digit_sum"}
    assert all("numkit.py" in t.files for t in tasks)


def test_task_source_draws_multibug_repositories() -> None:
    from tandem.agent_env import generate_multibug_tasks
    from tandem.orchestrator.rollout.tasks import TaskSource

    config = TaskConfig(family="multibug", repo_modules=5, buggy_modules=3, functions_per_repo=2)
    tasks = TaskSource(config, seed=4, offset=2).take(0, 2)
    expected = generate_multibug_tasks(
        4,
        2,
        start=2,
        modules=5,
        buggy=3,
        functions_per_module=2,
        kinds=config.kinds,
        hidden_per_function=config.hidden_per_function,
    )
    assert [t.id for t in tasks] == [t.id for t in expected] == ["multibug-4-2", "multibug-4-3"]
    assert tasks == expected
    assert all(len(t.reference_edits) == 3 for t in tasks)


def test_minimal_edit_makes_the_same_change_with_less_to_copy() -> None:
    tasks = generate_tasks(5, 40, functions_per_repo=1)
    shorter = tighter = 0
    for task in tasks:
        (edit,) = task.reference_edits
        text = task.files[edit.path]
        old, new = minimal_edit(text, edit.old, edit.new)
        assert text.count(old) == 1
        assert text.replace(old, new) == text.replace(edit.old, edit.new)
        assert len(old.strip()) >= min(10, len(edit.old.strip()))
        shorter += len(old) < len(edit.old)
        # A smaller minimum gives a span inside the default one, with the same effect.
        old4, new4 = minimal_edit(text, edit.old, edit.new, min_chars=4)
        assert old4 in old and text.count(old4) == 1
        assert text.replace(old4, new4) == text.replace(edit.old, edit.new)
        tighter += len(old4) < len(old)
    assert shorter >= len(tasks) // 2
    assert tighter >= len(tasks) // 4


def test_minimal_edit_keeps_an_ambiguous_replacement_as_it_is() -> None:
    text = "a = 1\nb = 1\n"
    assert minimal_edit(text, "= 1", "= 2") == ("= 1", "= 2")  # occurs twice
    assert minimal_edit(text, "a = 1", "a = 2", min_chars=3) == ("a = 1", "a = 2")
    # Widened word by word around the change until unique and at least min_chars long.
    text = "x = total + 1\ny = total - 1\n"
    assert minimal_edit(text, "x = total + 1", "x = total - 1") == ("= total + 1", "= total - 1")


def test_multibug_oracle_transcripts_take_ten_turns_or_more(chat) -> None:
    from tandem.agent_env import EnvConfig, generate_multibug_tasks
    from tandem.orchestrator.midtrain.transcripts import oracle_transcripts

    tasks = generate_multibug_tasks(3, 2, modules=4, buggy=3)
    env = EnvConfig(max_turns=14, partial_credit=True, system_prompt="Fix the bugs.")
    items = oracle_transcripts(
        tasks, env, chat, max_observation_chars=600, max_turns=14
    )  # skip_tools (the demo drops list_dir and run_tests) would keep 2 * buggy + 1 calls
    assert len(items) == len(tasks)  # every oracle episode resolved its task within the budget
    for (ids, _), task in zip(items, tasks, strict=True):
        text = chat.tok.decode(ids, keep_special=True)
        assert text.count("<|assistant|>") >= 10
        for edit in task.reference_edits:
            assert edit.path in text  # each buggy module is read and edited
