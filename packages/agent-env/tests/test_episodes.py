"""Episode lifecycle, grading semantics, trajectories, concurrency and the no-sandbox path."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgspec
import pytest

from tandem.agent_env import (
    Env,
    EnvConfig,
    HiddenTests,
    SandboxError,
    Task,
    TaskLimits,
    ToolCall,
    read_jsonl,
    run_episodes,
    tool_schemas,
    write_jsonl,
)

ADD_TASK = Task(
    id="add",
    instruction="`add(2, 3)` returns -1; it should return 5. Fix calc.py.",
    files={
        "calc.py": "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n",
        "tests/__init__.py": "",
        "tests/test_calc.py": (
            "import unittest\nfrom calc import mul\n\n\nclass T(unittest.TestCase):\n"
            "    def test_mul(self):\n        self.assertEqual(mul(2, 3), 6)\n"
        ),
    },
    hidden_tests=HiddenTests(
        fail_to_pass=("tests.test_hidden.H.test_add", "tests.test_hidden.H.test_add_neg"),
        pass_to_pass=("tests.test_calc.T.test_mul",),
        files={
            "tests/test_hidden.py": (
                "import unittest\nfrom calc import add\n\n\nclass H(unittest.TestCase):\n"
                "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n\n"
                "    def test_add_neg(self):\n        self.assertEqual(add(-2, 0), -2)\n"
            )
        },
        reset_paths=("tests/test_calc.py",),
    ),
)


def call(name: str, **args: object) -> ToolCall:
    return ToolCall(name, json.dumps(args))


async def _play(task: Task, config: EnvConfig, calls: list[ToolCall]) -> tuple[list, Env]:
    env = Env(task, config)
    await env.reset()
    results = []
    try:
        for c in calls:
            results.append(await env.step(c))
            if results[-1].done:
                break
    finally:
        await env.close()
    return results, env


def play(task: Task, config: EnvConfig, calls: list[ToolCall]) -> tuple[list, Env]:
    return asyncio.run(_play(task, config, calls))


def test_tool_schemas_are_openai_function_format() -> None:
    schemas = tool_schemas()
    names = [s["function"]["name"] for s in schemas]
    assert names == [
        "bash",
        "read_file",
        "search",
        "list_dir",
        "edit",
        "write_file",
        "run_tests",
        "submit",
    ]
    for s in schemas:
        assert s["type"] == "function"
        params = s["function"]["parameters"]
        assert params["type"] == "object" and set(params["required"]) <= set(params["properties"])
    schemas[0]["function"]["name"] = "changed"
    assert tool_schemas()[0]["function"]["name"] == "bash"


def test_file_tools_read_ranges_edit_once_and_search(config: EnvConfig) -> None:
    results, _ = play(
        ADD_TASK,
        config,
        [
            call("read_file", path="calc.py", start_line=2, end_line=2),
            call("edit", path="calc.py", old_string="return a", new_string="return x"),
            call("edit", path="calc.py", old_string="nothing like this", new_string="x"),
            call("edit", path="calc.py", old_string="a - b", new_string="a + b"),
            call("search", pattern="a [+*] b", glob="*.py"),
            call("list_dir", depth=2),
            call("write_file", path="pkg/new.py", content="X = 1\n"),
            call("bash", command="cat pkg/new.py; cd tests; pwd"),
            call("bash", command="pwd"),
            call("read_file", path="missing.py"),
        ],
    )
    out = [r.observation.content for r in results]
    assert out[0] == "     2\t    return a - b"
    assert "matches 2 times" in out[1] and results[1].observation.is_error
    assert "not found" in out[2]
    assert "return a + b" in out[3]
    assert out[4].splitlines() == ["calc.py:2:    return a + b", "calc.py:6:    return a * b"]
    assert "tests/test_calc.py" in out[5].splitlines()
    assert "wrote 6 bytes to pkg/new.py" in out[6]
    assert "X = 1" in out[7] and "/workspace/tests" in out[7]
    assert out[8].startswith("/workspace/tests\n")  # one persistent shell: `cd` carries over
    assert "no such file" in out[9]


def test_reward_one_only_when_all_hidden_tests_pass(config: EnvConfig) -> None:
    fixed, env = play(
        ADD_TASK,
        config,
        [call("edit", path="calc.py", old_string="a - b", new_string="a + b"), call("submit")],
    )
    assert fixed[-1].done and fixed[-1].reward == 1.0 and fixed[-1].info["resolved"]
    traj = env.trajectory()
    assert traj.termination == "submitted" and traj.turns == 2
    assert set(traj.test_results.values()) == {"passed"}

    # half a fix: one fail-to-pass test passes -> 0, or 2/3 with partial credit
    half = [
        call("edit", path="calc.py", old_string="a - b", new_string="a + b if b else 0"),
        call("submit"),
    ]
    res, _ = play(ADD_TASK, config, half)
    assert res[-1].reward == 0.0
    res, _ = play(ADD_TASK, msgspec.structs.replace(config, partial_credit=True), half)
    assert res[-1].reward == pytest.approx(2 / 3)


def test_test_files_the_agent_touched_are_reset_before_grading(config: EnvConfig) -> None:
    cheat = [
        call(
            "write_file",
            path="tests/test_hidden.py",
            content="import unittest\nclass H(unittest.TestCase):\n    pass\n",
        ),
        call("write_file", path="tests/test_calc.py", content="raise SystemExit\n"),
        call("write_file", path="unittest.py", content="raise SystemExit('shadowed')\n"),
        call("submit"),
    ]
    res, env = play(ADD_TASK, config, cheat)
    assert res[-1].reward == 0.0
    results = env.trajectory().test_results
    assert results["tests.test_hidden.H.test_add"] == "failed"
    assert results["tests.test_calc.T.test_mul"] == "passed"


def test_turn_limit_ends_and_grades_the_episode(config: EnvConfig) -> None:
    task = msgspec.structs.replace(ADD_TASK, limits=TaskLimits(max_turns=2))
    res, env = play(task, config, [call("bash", command="true")] * 5)
    assert len(res) == 2 and res[-1].done and res[-1].reward == 0.0
    assert env.trajectory().termination == "turn_limit"


def test_grader_that_cannot_run_is_an_infra_fault_not_a_zero(config: EnvConfig) -> None:
    # a task whose hidden tests cannot be run here (a framework the runner does not know)
    hidden = msgspec.structs.replace(ADD_TASK.hidden_tests, framework="nose2")
    task = msgspec.structs.replace(ADD_TASK, hidden_tests=hidden)
    res, env = play(
        task,
        config,
        [call("edit", path="calc.py", old_string="a - b", new_string="a + b"), call("submit")],
    )
    assert res[-1].done and res[-1].reward is None and res[-1].info["infra_fault"]
    traj = env.trajectory()
    assert traj.infra_fault and traj.termination == "infra_fault" and "nose2" in traj.grade_detail


def test_a_misconfigured_interpreter_is_refused_at_reset(config: EnvConfig) -> None:
    broken = msgspec.structs.replace(
        config, sandbox=msgspec.structs.replace(config.sandbox, python="/usr/bin/no-such-python")
    )
    with pytest.raises(SandboxError, match="sandbox does not work"):
        play(ADD_TASK, broken, [call("submit")])


def test_trajectory_messages_and_jsonl_roundtrip(config: EnvConfig, tmp_path: Path) -> None:
    _, env = play(
        ADD_TASK,
        config,
        [
            ToolCall(
                "bash",
                '{"command": "echo hi"}',
                id="c1",
                content="let me look",
                metadata={"token_ids": [1, 2]},
            ),
            call("submit"),
        ],
    )
    traj = env.trajectory()
    assert [m["role"] for m in traj.messages] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
    ]
    a = traj.messages[2]
    assert a["content"] == "let me look"
    assert a["tool_calls"][0] == {
        "id": "c1",
        "type": "function",
        "function": {"name": "bash", "arguments": '{"command": "echo hi"}'},
    }
    assert traj.messages[3] == {
        "role": "tool",
        "tool_call_id": "c1",
        "content": "hi\n[exit code 0]",
    }
    assert traj.steps[0].policy == {"token_ids": [1, 2]}
    write_jsonl(tmp_path / "t.jsonl", [traj, traj])
    back = list(read_jsonl(tmp_path / "t.jsonl"))
    assert back == [traj, traj]


def test_256_concurrent_episodes_have_no_cross_talk(config: EnvConfig) -> None:
    n = 256
    tasks = [msgspec.structs.replace(ADD_TASK, id=f"ep{i}") for i in range(n)]

    started = asyncio.Event()
    live = 0
    peak = 0

    async def one(i: int) -> tuple[str, str]:
        nonlocal live, peak
        env = Env(tasks[i], config)
        await env.reset()
        live += 1
        peak = max(peak, live)
        if live == n:
            started.set()
        try:
            await env.step(call("write_file", path=f"mine-{i}.txt", content=f"episode {i}"))
            await env.step(
                call("edit", path="calc.py", old_string="a - b", new_string=f"a + b + {i} - {i}")
            )
            await asyncio.wait_for(started.wait(), 120)  # all 256 sandboxes are alive at once
            listing = await env.step(
                call(
                    "bash",
                    command="ls; cat mine-*.txt; grep -c 'a + b' calc.py; echo; grep 'a + b' calc.py",
                )
            )
            if i % 16:  # grade a sample: grading sees exactly this episode's final workspace
                return listing.observation.content, "not graded"
            res = await env.step(call("submit"))
            return listing.observation.content, f"{res.reward}"
        finally:
            live -= 1
            await env.close()

    async def main() -> list[tuple[str, str]]:
        return await asyncio.gather(*(one(i) for i in range(n)))

    outs = asyncio.run(main())
    assert peak == n
    for i, (listing, reward) in enumerate(outs):
        files = [ln for ln in listing.splitlines() if ln.startswith("mine-")]
        assert files == [f"mine-{i}.txt"], (i, listing)
        assert f"episode {i}" in listing
        assert f"a + b + {i} - {i}" in listing
        assert reward == ("1.0" if i % 16 == 0 else "not graded")


def test_without_a_sandbox_env_refuses_unless_allowed(config: EnvConfig) -> None:
    nobwrap = msgspec.structs.replace(
        config, sandbox=msgspec.structs.replace(config.sandbox, bwrap="/nonexistent/bwrap")
    )
    with pytest.raises(SandboxError, match="allow_unsandboxed=True"):
        play(ADD_TASK, nobwrap, [call("submit")])
    res, env = asyncio.run(_play_unsandboxed(nobwrap))
    assert res[-1].reward == 1.0 and env.trajectory().termination == "submitted"


async def _play_unsandboxed(config: EnvConfig) -> tuple[list, Env]:
    env = Env(ADD_TASK, config, allow_unsandboxed=True)
    await env.reset()
    try:
        r1 = await env.step(call("edit", path="calc.py", old_string="a - b", new_string="a + b"))
        r2 = await env.step(call("submit"))
    finally:
        await env.close()
    return [r1, r2], env


def test_run_episodes_marks_policy_failures_as_infra_faults(config: EnvConfig) -> None:
    async def flaky(messages: list[dict]) -> ToolCall:
        raise ConnectionError("inference server went away")

    (traj,) = asyncio.run(run_episodes(flaky, [ADD_TASK], concurrency=1, config=config))
    assert traj.infra_fault and traj.reward is None and traj.termination == "policy_error"


def test_unused_base_layers_are_evicted_beyond_the_cache_size(config: EnvConfig) -> None:
    from tandem.agent_env.sandbox.runtime import Runtime

    rt = Runtime.shared(config.sandbox)
    old, rt.max_cached_bases = rt.max_cached_bases, 2
    tasks = [msgspec.structs.replace(ADD_TASK, id=f"evict{i}") for i in range(5)]

    async def main() -> tuple[list[str], str]:
        keep = Env(tasks[0], config)  # stays in use while the others come and go
        await keep.reset()
        try:
            for t in tasks[1:]:
                env = Env(t, config)
                await env.reset()
                await env.close()
            built = [p.name for p in (rt.root / "bases").iterdir() if not p.name.startswith(".")]
            r = await keep.step(call("read_file", path="calc.py"))
            return built, r.observation.content
        finally:
            await keep.close()

    try:
        built, seen = asyncio.run(main())
    finally:
        rt.max_cached_bases = old
    assert len(built) == 2
    assert "return a - b" in seen  # the base in use was not evicted


def test_run_tests_reports_no_wall_clock_time(config: EnvConfig) -> None:
    """The runner's "Ran 1 test in 0.001s" would make the same calls give other tokens on a
    busier machine (a mid-training transcript against the rollout replaying it)."""
    res, _ = play(ADD_TASK, config, [call("run_tests")])
    text = res[0].observation.content
    assert "\nRan 1 test\n" in text and "OK" in text and "Ran 1 test in" not in text, text
