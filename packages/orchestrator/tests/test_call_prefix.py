"""CallPrefix: never stops a well-formed call, and only stops turns that cannot parse."""

from __future__ import annotations

import json
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.agent_env import Env
from tandem.orchestrator.inference.call_prefix import CallPrefix, tool_arguments
from tandem.orchestrator.inference.chat_format import ChatFormat, ToolCall, ToolCallFormatError

TOOLS = tool_arguments(Env.tool_schemas())
CHAT = ChatFormat()


def first_stop(ids: list[int]) -> int | None:
    """Index of the first token CallPrefix rejects, or None."""
    check = CallPrefix(CHAT, TOOLS)
    for i, t in enumerate(ids):
        if not check.push(t):
            return i
    return None


def acceptable(ids: list[int]) -> bool:
    """The independent verdict: the parser accepts the turn and the env knows the call's names."""
    try:
        call = CHAT.parse_assistant(ids).tool_call
    except ToolCallFormatError:
        return False
    return call.name in TOOLS and set(call.arguments) <= TOOLS[call.name]


def turn(text_before: str, name: str, raw_args: str) -> list[int]:
    return [
        *CHAT.tok.encode(text_before),
        CHAT.call_open,
        *CHAT.tok.encode(f"{name} {raw_args}" if raw_args else name),
        CHAT.call_close,
        CHAT.end_id,
    ]


values = st.one_of(
    st.text(max_size=20),
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
    st.none(),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2),
)


@st.composite
def calls(draw: st.DrawFn) -> tuple[str, dict]:
    name = draw(st.sampled_from(sorted(TOOLS)))
    keys = draw(st.lists(st.sampled_from(sorted(TOOLS[name]) or ["x"]), unique=True))
    args = {k: draw(values) for k in keys if k in TOOLS[name]}
    return name, args


@settings(max_examples=300, deadline=None)
@given(
    calls(),
    st.sampled_from([None, 1, 2]),
    st.booleans(),
    st.text(max_size=10).filter(lambda s: "\x00" not in s),
)
def test_well_formed_calls_are_never_stopped(call, indent, ascii_only, before) -> None:
    name, args = call
    raw = json.dumps(args, indent=indent, ensure_ascii=ascii_only)
    ids = turn(before, name, raw)
    assert acceptable(ids)
    assert first_stop(ids) is None
    rendered = [*CHAT.render_tool_call(ToolCall(name=name, arguments=args)), CHAT.end_id]
    assert first_stop(rendered) is None


def test_escaped_keys_literals_and_empty_arguments_pass() -> None:
    for name, raw in [
        ("read_file", '{"pa\\u0074h": "a.py", "start_line": -0.5e+3}'),
        ("bash", ' { "command" : "echo \\"hi\\"\\n\\t\\\\" } '),
        ("submit", ""),
        ("submit", "  "),
        ("submit", "{}"),
        ("edit", '{"path": [true, false, null, NaN, Infinity, -Infinity, {"a": [[]]}]}'),
    ]:
        ids = turn("thinking ", name, raw)
        assert first_stop(ids) is None, raw
        assert CHAT.parse_assistant(ids).tool_call.name == name


def mutate(ids: list[int], rng: random.Random) -> list[int]:
    out = list(ids)
    for _ in range(rng.randint(1, 3)):
        pos = rng.randrange(len(out))
        op = rng.random()
        tok = rng.choice(
            [*b'{}[]":, \\\n0e-.aZ_', rng.randrange(CHAT.tok.vocab_size), CHAT.call_close]
        )
        if op < 0.4:
            out[pos] = tok
        elif op < 0.8:
            out.insert(pos, tok)
        elif len(out) > 1:
            del out[pos]
    return out


def test_a_stopped_turn_never_parses_whatever_follows() -> None:
    """Mutated calls: a stop means the turn fails, and so does any repair of its suffix."""
    rng = random.Random(0)
    base = [
        turn("", "edit", json.dumps({"path": "a.py", "old_string": "i -= 1", "new_string": "x"})),
        turn("", "read_file", '{"path": "toolbelt.py", "start_line": 10, "end_line": 12}'),
        turn("ok ", "bash", json.dumps({"command": 'grep -n "x" a.py'})),
        turn("", "submit", "{}"),
    ]
    stopped = 0
    for _ in range(3000):
        ids = mutate(rng.choice(base), rng)
        stop = first_stop(ids)
        if stop is None:
            continue
        stopped += 1
        assert not acceptable(ids), CHAT.tok.decode(ids)
        # no continuation of the stopped prefix taken from any well-formed call repairs it
        for good in base:
            for cut in range(0, len(good), 7):
                assert not acceptable(ids[: stop + 1] + good[cut:])
    assert stopped > 1000  # the mutations are caught, not waved through


def test_junk_stops_at_its_first_wrong_byte() -> None:
    text = '{"path":"toolbelt.py","old_string":"number 1:"new_string"}'
    ids = turn("", "edit", text)
    stop = first_stop(ids)
    assert stop is not None
    assert CHAT.tok.decode(ids[: stop + 1]).endswith('"number 1:"n')
    assert first_stop(turn("", "edit", '{"path":"a","n ng":"x"}')) is not None
    assert first_stop(turn("", "bsh", "{}")) == 2  # "b" may still become "bash"; "bs" may not
    assert first_stop([CHAT.role_ids["user"]]) == 0
    assert first_stop([CHAT.call_close]) == 0


def test_engine_ends_the_turn_at_the_first_rejected_token(chat, tiny_policy, make_engine) -> None:
    engine = make_engine(tiny_policy)
    prompt = chat.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)[0]
    seen: list[int] = []

    def three_tokens(tok: int) -> bool:
        seen.append(tok)
        return len(seen) < 3

    slot = engine.acquire()
    engine.submit(slot, prompt, torch.Generator().manual_seed(0), 20, three_tokens)
    outs = []
    while not outs:
        outs = engine.step()
    (_, out) = outs[0]
    assert out.tokens == seen
    if chat.end_id in seen[:2]:
        assert out.tokens[-1] == chat.end_id and not out.truncated
    else:
        assert len(out.tokens) == 3 and out.truncated
    assert len(out.logprobs) == len(out.versions) == len(out.tokens)


@pytest.mark.parametrize("raw", ['{"path":"a"}x', '{"path":"a"', "[]", '{"path":01}'])
def test_trailing_or_missing_bytes_stop_or_fail_at_the_close(raw: str) -> None:
    ids = turn("", "read_file", raw)
    assert not acceptable(ids)
    assert first_stop(ids) is not None


def _generated_turns(sample) -> list[list[int]]:
    turns, cur = [], []
    for tok, m in zip(sample.tokens, sample.loss_mask, strict=True):
        if m:
            cur.append(tok)
        elif cur:
            turns.append(cur)
            cur = []
    return [*turns, cur] if cur else turns


def test_episodes_follow_the_engine_setting(chat, tiny_policy, make_engine) -> None:
    """With ``stop_malformed`` (the engine config's) a turn's first rejected token is its
    last; without, it is not."""
    import asyncio

    from tandem.agent_env import EnvConfig, generate_tasks
    from tandem.orchestrator.inference.embedded.server import EngineServer
    from tandem.orchestrator.rollout.episode import episode_generator, run_token_episode

    task = generate_tasks(seed=0, n=1)[0]
    config = EnvConfig(max_turns=3, allow_unsandboxed=True)

    def play(stop: bool) -> list:
        engine = make_engine(tiny_policy, max_len=2048, max_new_tokens=24, stop_malformed=stop)

        async def go() -> list:
            server = EngineServer(engine)
            serve = asyncio.create_task(server.serve())
            try:
                return list(
                    await asyncio.gather(
                        *(
                            run_token_episode(
                                server,
                                chat,
                                task,
                                config,
                                max_new_tokens=24,
                                max_observation_chars=200,
                                generator=episode_generator(0, j),
                                stop_malformed=stop,
                            )
                            for j in range(6)
                        )
                    )
                )
            finally:
                server.close()
                await asyncio.gather(serve, return_exceptions=True)

        return asyncio.run(go())

    def stops(samples) -> list[tuple[int | None, int]]:
        return [(first_stop(t), len(t)) for s in samples for t in _generated_turns(s)]

    stopped = stops(play(True))
    assert all(i is None or i == n - 1 for i, n in stopped)
    assert any(i is not None for i, _ in stopped)  # the random policy does slip
    assert any(i is not None and i < n - 1 for i, n in stops(play(False)))
