"""The run config's ``[env]`` is agent-env's own config: a generated task graded in the sandbox
with the settings a TOML table gives."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from tandem.agent_env import Env, EnvConfig, ToolCall
from tandem.orchestrator.config import RunConfig, TaskConfig
from tandem.orchestrator.rollout.tasks import TaskSource

# a task whose hidden tests include pass-to-pass ones, which an unfixed workspace passes
TASK = TaskSource(TaskConfig(kinds=["off_by_one"], functions=["digit_sum"]), seed=5)[0]


def _grade_untouched(settings: EnvConfig) -> tuple[float, bool, dict[str, str]]:
    """Submit a generated task without fixing it; (reward, resolved, per-test outcomes)."""

    async def go() -> tuple[float, bool, dict[str, str]]:
        env = Env(TASK, settings)
        await env.reset()
        try:
            res = await env.step(ToolCall("submit", json.dumps({})))
        finally:
            await env.close()
        assert res.done
        return float(res.reward), bool(res.info["resolved"]), res.info["tests"]

    return asyncio.run(go())


@pytest.mark.parametrize("partial", [False, True])
def test_partial_credit_setting_grades_the_fraction_of_hidden_tests(partial: bool) -> None:
    config = msgspec.convert({"env": {"partial_credit": partial}}, RunConfig)
    reward, resolved, tests = _grade_untouched(config.env)
    assert not resolved  # the bug is still there: its fail-to-pass tests fail
    wanted = [*TASK.hidden_tests.fail_to_pass, *TASK.hidden_tests.pass_to_pass]
    passed = sum(tests.get(t) == "passed" for t in wanted)
    assert 0 < passed < len(wanted)  # ...while the pass-to-pass ones pass
    expected = passed / len(wanted) if partial else 0.0
    assert reward == pytest.approx(expected)


def test_renamed_locals_reach_the_tasks_and_the_multibug_family_refuses_them() -> None:
    from tandem.agent_env import generate_tasks
    from tandem.orchestrator.config import ConfigValueError, TaskConfig
    from tandem.orchestrator.rollout.tasks import TaskSource

    config = TaskConfig(functions=["chunked"], rename_locals=True)
    task = TaskSource(config, 5)[3]
    same = generate_tasks(
        5,
        1,
        start=3,
        kinds=config.kinds,
        functions=["chunked"],
        functions_per_repo=1,
        hidden_per_function=config.hidden_per_function,
        rename_locals=True,
    )
    assert task == same[0]
    plain = TaskSource(TaskConfig(functions=["chunked"]), 5)[3]
    assert task.files != plain.files
    with pytest.raises(ConfigValueError, match="rename_locals: applies to the single family only"):
        TaskConfig(family="multibug", rename_locals=True)
