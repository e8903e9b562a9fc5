"""Detour transcripts: a wrong sibling fix first, the real tool's error, then the task's fix."""

from __future__ import annotations

import msgspec
import pytest

from tandem.agent_env import EnvConfig, generate_tasks
from tandem.orchestrator.config import ConfigValueError, MidtrainConfig
from tandem.orchestrator.midtrain.detours import plan_detours
from tandem.orchestrator.midtrain.transcripts import minimal_edit, oracle_transcripts

FAMILY = dict(
    kinds=["wrong_operator", "off_by_one", "swapped_arguments"],
    functions=["gcd", "chunked"],
    modules=["toolbelt"],
    functions_per_repo=1,
)
NOT_FOUND = "old_string not found"


def _narrow(text: str, old: str, new: str) -> tuple[str, str]:
    return minimal_edit(text, old, new, 4)


@pytest.fixture(scope="module")
def tasks():
    return generate_tasks(7, 24, **FAMILY)


def test_decoys_are_sibling_fixes_absent_from_the_file(tasks) -> None:
    plans = plan_detours(tasks, 1.0, 2, _narrow)
    by_id = {t.id: t for t in tasks}
    sibling_fixes = {}
    for t in tasks:
        e = t.reference_edits[0]
        sibling_fixes.setdefault(t.metadata["function"], set()).add(
            (e.path, *_narrow(t.files[e.path], e.old, e.new))
        )
    assert len(plans) == len(tasks)  # every task of this family has a sibling to mistake
    counts = set()
    for task_id, decoys in plans.items():
        task = by_id[task_id]
        counts.add(len(decoys))
        olds = [old for _, old, _ in decoys]
        assert len(set(olds)) == len(olds)
        for path, old, new in decoys:
            assert old not in task.files[path]
            assert (path, old, new) in sibling_fixes[task.metadata["function"]]
    assert counts == {1, 2}


def test_plans_depend_only_on_the_tasks(tasks) -> None:
    half = plan_detours(tasks, 0.5, 1, _narrow)
    assert half == plan_detours(list(reversed(tasks)), 0.5, 1, _narrow)
    assert 0 < len(half) < len(tasks)
    assert all(len(d) == 1 for d in half.values())
    assert plan_detours(tasks, 0.0, 2, _narrow) == {}
    assert plan_detours(tasks, 1.0, 0, _narrow) == {}


def test_a_task_without_a_function_gets_no_detour(tasks) -> None:
    bare = [msgspec.structs.replace(t, metadata={}) for t in tasks]
    assert plan_detours(bare, 1.0, 2, _narrow) == {}


def _turns(chat, ids: list[int]) -> str:
    return chat.tok.decode(ids, keep_special=True)


@pytest.mark.parametrize("max_turns", [3, 5])
def test_detour_transcripts_recover_within_the_turn_budget(chat, tasks, max_turns) -> None:
    few = tasks[:6]
    env = EnvConfig(max_turns=12, system_prompt="Fix the bug.")
    common = dict(
        max_observation_chars=600,
        skip_tools=["list_dir", "run_tests"],
        edit_min_chars=4,
        max_turns=max_turns,
    )
    plain = oracle_transcripts(few, env, chat, **common)
    detoured = oracle_transcripts(few, env, chat, detour_fraction=1.0, **common)
    assert len(plain) == len(detoured) == len(few)  # every detour still solves its task
    for (p_ids, p_mask), (d_ids, d_mask), task in zip(plain, detoured, few, strict=True):
        text = _turns(chat, d_ids)
        errors = text.count(NOT_FOUND)
        assert 1 <= errors <= max_turns - 2
        assert NOT_FOUND not in _turns(chat, p_ids)
        # the task's own fix comes after the last error, and the detour's tokens are trained
        edit = task.reference_edits[0]
        own = _narrow(task.files[edit.path], edit.old, edit.new)[0]
        assert text.rindex(own) > text.rindex(NOT_FOUND)
        assert text.count("<|assistant|>") <= max_turns
        assert sum(d_mask) > sum(p_mask)


def test_detour_fraction_out_of_range_names_the_field() -> None:
    with pytest.raises(ConfigValueError, match="detour_fraction"):
        MidtrainConfig(detour_fraction=1.5)
