"""What a policy may return: tool calls in every OpenAI shape, several per turn, plain text.

The SDK's classes are stood in for by look-alikes with the same attributes (agent-env never
imports ``openai``), so what is tested is exactly the duck typing the package promises.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest

from tandem.agent_env import (
    TEXT_ANSWER_OBSERVATION,
    Env,
    EnvConfig,
    Task,
    TaskLimits,
    ToolCall,
    render_text,
    run_episodes,
)

FIX = {"path": "calc.py", "old_string": "a - b", "new_string": "a + b"}
BREAK = {"path": "calc.py", "old_string": "a + b", "new_string": "a * b"}


# -- look-alikes of openai.types.chat (same attribute names, nothing else) ----------------


@dataclass
class Function:
    name: str
    arguments: str


@dataclass
class ChatCompletionMessageToolCall:
    id: str
    function: Function
    type: str = "function"


@dataclass
class ChatCompletionMessage:
    content: str | None = None
    tool_calls: list[ChatCompletionMessageToolCall] | None = None
    role: str = "assistant"
    refusal: str | None = None


@dataclass
class ChatCompletion:  # the whole response: returning it is a developer mistake
    choices: list[Any] = field(default_factory=list)


def sdk_call(call_id: str, name: str, **args: Any) -> ChatCompletionMessageToolCall:
    return ChatCompletionMessageToolCall(call_id, Function(name, json.dumps(args)))


def dict_call(call_id: str, name: str, **args: Any) -> dict[str, Any]:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args)},
    }


async def _play(task: Task, config: EnvConfig, replies: list[Any]) -> tuple[list, Env]:
    env = Env(task, config)
    await env.reset()
    results = []
    try:
        for reply in replies:
            results.append(await env.step(reply))
            if results[-1].done:
                break
    finally:
        await env.close()
    return results, env


def play(replies: list[Any], config: EnvConfig, task: Task) -> tuple[list, Env]:
    return asyncio.run(_play(task, config, replies))


def test_sdk_tool_call_objects_run_as_tool_calls(config: EnvConfig, add_task: Task) -> None:
    """The defect: an SDK tool-call object was an 'unknown tool' for the agent."""
    res, env = play(
        [
            sdk_call("call_a", "edit", **FIX),
            ChatCompletionMessage(content="done", tool_calls=[sdk_call("call_b", "submit")]),
        ],
        config,
        add_task,
    )
    assert not res[0].observation.is_error, res[0].observation.content
    assert res[-1].done and res[-1].reward == 1.0
    traj = env.trajectory()
    assert traj.termination == "submitted" and traj.turns == 2
    assistant = [m for m in traj.messages if m["role"] == "assistant"]
    assert assistant[0]["tool_calls"] == [dict_call("call_a", "edit", **FIX)]
    assert assistant[1]["content"] == "done"
    assert [m["tool_call_id"] for m in traj.messages if m["role"] == "tool"] == [
        "call_a",
        "call_b",
    ]


def test_several_calls_in_one_turn_run_in_order_one_observation_each(
    config: EnvConfig, add_task: Task
) -> None:
    message = {
        "role": "assistant",
        "content": "three at once",
        "tool_calls": [
            dict_call("c1", "write_file", path="a.txt", content="first\n"),
            dict_call("c2", "bash", command="cat a.txt"),
            dict_call("c3", "read_file", path="missing.py"),
        ],
    }
    pair = [ToolCall("bash", '{"command": "echo x"}', metadata={"k": 1}), ToolCall("run_tests")]
    res, env = play([message, pair], config, add_task)
    first, second = res
    assert [o.content for o in first.observations] == [
        "wrote 6 bytes to a.txt",
        "first\n[exit code 0]",
        first.observations[2].content,
    ]
    assert "no such file" in first.observations[2].content
    assert first.observations[2].is_error and first.observation == first.observations[2]
    assert not first.done and env.turn == 2 and len(second.observations) == 2
    traj = env.trajectory()
    roles = " ".join(m["role"] for m in traj.messages)
    assert roles == "system user assistant tool tool tool assistant tool tool"
    a = traj.messages[2]
    assert a["content"] == "three at once" and a["tool_calls"] == message["tool_calls"]
    assert [m["tool_call_id"] for m in traj.messages[3:6]] == ["c1", "c2", "c3"]
    # calls without ids get distinct ones, and their tool messages answer them
    ids = [c["id"] for c in traj.messages[6]["tool_calls"]]
    assert len(set(ids)) == 2 and all(ids)
    assert [m["tool_call_id"] for m in traj.messages[7:]] == ids
    assert [(s.turn, s.tool) for s in traj.steps] == [
        (1, "write_file"),
        (1, "bash"),
        (1, "read_file"),
        (2, "bash"),
        (2, "run_tests"),
    ]
    assert [s.policy for s in traj.steps[3:]] == [{"k": 1}, {}]  # each call's own metadata
    assert "three at once" in render_text(traj)


def test_a_turn_is_one_assistant_message_however_many_calls(
    config: EnvConfig, add_task: Task
) -> None:
    task = msgspec.structs.replace(add_task, limits=TaskLimits(max_turns=2))
    three = [ToolCall("bash", json.dumps({"command": f"echo {i}"})) for i in range(3)]
    res, env = play([three, three, three], config, task)
    assert len(res) == 2 and not res[0].done and res[1].done
    assert len(res[1].observations) == 3  # the limit is checked after the whole turn
    traj = env.trajectory()
    assert traj.termination == "turn_limit" and traj.turns == 2 and len(traj.steps) == 6


def test_calls_after_submit_in_the_same_turn_are_not_run(config: EnvConfig, add_task: Task) -> None:
    res, env = play(
        [
            [
                sdk_call("fix", "edit", **FIX),
                sdk_call("sub", "submit"),
                sdk_call("late", "edit", **BREAK),  # would make the reward 0 if it ran
            ]
        ],
        config,
        add_task,
    )
    (r,) = res
    assert r.done and r.reward == 1.0 and r.info["termination"] == "submitted"
    assert r.observation.content == "submitted"
    late = r.observations[2]
    assert late.is_error and "not run" in late.content and "submit" in late.content
    traj = env.trajectory()
    tools = [m for m in traj.messages if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tools] == ["fix", "sub", "late"]  # every call answered
    assert [s.info.get("not_run", False) for s in traj.steps] == [False, False, True]


def test_calls_after_the_time_budget_ran_out_are_not_run(config: EnvConfig, add_task: Task) -> None:
    task = msgspec.structs.replace(add_task, limits=TaskLimits(episode_wall_s=0.5))
    slow = [ToolCall("bash", '{"command": "sleep 0.7"}'), ToolCall("edit", json.dumps(FIX))]
    (r,), _ = play([slow], config, task)
    assert r.done and r.info["termination"] == "wall_limit" and r.reward == 0.0
    assert r.observation == r.observations[0]  # the sleep ran (the first call always runs)
    assert "not run" in r.observations[1].content and "time" in r.observations[1].content


def test_a_text_answer_gets_a_documented_observation_and_costs_the_turn(
    config: EnvConfig, add_task: Task
) -> None:
    text_reply = {"role": "assistant", "content": "The bug is in add.", "tool_calls": None}
    res, env = play(
        [
            "I will look at calc.py first.",
            text_reply,
            ChatCompletionMessage(content="Still thinking."),
            ToolCall("submit"),
        ],
        config,
        add_task,
    )
    assert [r.observation.content for r in res[:3]] == [TEXT_ANSWER_OBSERVATION] * 3
    assert all(r.observation.is_error and not r.done for r in res[:3])
    assert res[3].done and env.trajectory().turns == 4
    msgs = env.trajectory().messages
    assert msgs[2] == {"role": "assistant", "content": "I will look at calc.py first."}
    assert msgs[3] == {"role": "user", "content": TEXT_ANSWER_OBSERVATION}
    assert msgs[4] == {"role": "assistant", "content": "The bug is in add."}
    assert [s.tool for s in env.trajectory().steps] == ["", "", "", "submit"]
    text = render_text(env.trajectory())
    assert (
        f"<assistant>\nI will look at calc.py first.\n\n<user>\n{TEXT_ANSWER_OBSERVATION}" in text
    )

    task = msgspec.structs.replace(add_task, limits=TaskLimits(max_turns=1))
    (last,), env = play(["no tools for me"], config, task)
    assert last.done and last.reward == 0.0 and env.trajectory().termination == "turn_limit"


@pytest.mark.parametrize(
    ("reply", "named"),
    [
        (42, "int"),
        (None, "None"),
        ({"foo": 1}, "foo"),
        ([ToolCall("submit"), 7], "int"),
        (ChatCompletion(), "choices[0].message"),
        (ChatCompletionMessage(content=3), "content"),  # type: ignore[arg-type]
    ],
)
def test_anything_else_is_a_developer_error_not_an_observation(
    config: EnvConfig, reply: Any, named: str, add_task: Task
) -> None:
    async def main() -> Env:
        env = Env(add_task, config)
        await env.reset()
        try:
            with pytest.raises(TypeError, match="policy returned") as e:
                await env.step(reply)
            assert named in str(e.value)
            assert env.turn == 0 and len(env.messages) == 2 and not env.done  # nothing changed
            assert (await env.step(ToolCall("list_dir"))).observation.content
        finally:
            await env.close()
        return env

    asyncio.run(main())


def test_run_episodes_raises_the_developer_error(config: EnvConfig, add_task: Task) -> None:
    calls = 0
    seen: list[str] = []

    async def buggy(messages: list[dict[str, Any]]) -> Any:
        nonlocal calls
        calls += 1
        return 42 if calls == 3 else ToolCall("list_dir")

    with pytest.raises(TypeError, match="policy returned int"):
        asyncio.run(
            run_episodes(
                buggy,
                [add_task] * 6,
                concurrency=3,
                config=config,
                on_trajectory=lambda t: seen.append(t.termination),
            )
        )
    assert seen == []  # the others stopped at their next turn (and closed their sandboxes)
