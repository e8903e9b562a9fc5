"""vLLM as the engine: a real vLLM server (its own environment, created by tandem with uv on
first use and cached) serving a tiny tandem MoE, driven through the `Engine` protocol.

One server for the module (a start takes tens of seconds on two cores). Its log-probs are
checked against tandem's own forward of the same tokens, computed here independently.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest
import torch

from tandem.delta_sync import LocalStore, Publisher
from tandem.moe_determinism import MoEConfig, MoETransformer
from tandem.moe_determinism.logprobs import sampling_logits, target_logprobs
from tandem.moe_determinism.model.hf import hf_layout, save_hf
from tandem.orchestrator.config import ConfigValueError, EngineConfig, RunConfig, VllmConfig
from tandem.orchestrator.inference.vllm.engine import VllmEngine
from tandem.orchestrator.inference.vllm.environment import vllm_python
from tandem.orchestrator.inference.vllm.errors import VllmServerFailed
from tandem.orchestrator.inference.vllm.server import VllmServer
from tandem.orchestrator.inference.vllm.serving import check_servable
from tandem.orchestrator.inference.vllm.weights import VllmWeights
from tandem.orchestrator.protocols import EngineStopped

MODEL = MoEConfig(
    vocab_size=266,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # vLLM's CPU attention has no head size below 32
    moe_intermediate_size=64,
    num_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=1024,
)
ENGINE = EngineConfig(kind="vllm", max_slots=8, max_len=512, max_new_tokens=24)
STOP = 7
PROMPT = [1, 3, 70, 105, 120, 32, 116, 104, 101, 32, 98, 117, 103, 7, 4, 104, 105, 7, 5]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    """(server, model): a random tiny MoE written by `save_hf` and a server on it."""
    torch.manual_seed(11)
    model = MoETransformer(MODEL).eval()
    with torch.no_grad():  # larger logits than the default init: sampled tokens vary more
        model.lm_head.weight.mul_(20)
    directory = save_hf(model, tmp_path_factory.mktemp("policy"))
    server = VllmServer.start(
        vllm_python(), directory, ENGINE, log_path=directory / "server.log", seed=0
    )
    yield server, model
    server.close()


def engine_on(url: str, **kw: object) -> VllmEngine:
    return VllmEngine(
        [url], ENGINE, stop_id=STOP, vocab=266, model_vocab=266, route_shape=(2, 2), **kw
    )


def reference_logprobs(model: MoETransformer, tokens: list[int], start: int) -> torch.Tensor:
    """tandem's log-probs (temperature 1) of tokens[start:] given what precedes each."""
    ids = torch.tensor([tokens])
    with torch.no_grad():
        logits = model(ids[:, :-1], torch.tensor([len(tokens) - 1])).logits.float()
    lp = target_logprobs(sampling_logits(logits, 1.0, 266), ids[:, 1:])[0]
    return lp[start - 1 :]


def turns(url: str, plan: list[tuple[list[int], int]], **kw: object):
    """Play turns on one slot: each (feed, seed); returns the outputs and the slot's tokens."""

    async def go():
        engine = engine_on(url, **kw)
        slot = await engine.acquire()
        outs, tokens = [], []
        for feed, seed in plan:
            out = await engine.generate(
                slot, list(feed), torch.Generator().manual_seed(seed), ENGINE.max_new_tokens
            )
            outs.append(out)
            tokens += feed if not tokens else feed[1:]  # a later feed starts with the last token
            tokens += out.tokens
        engine.release(slot)
        await engine.close()
        return outs, tokens

    return asyncio.run(go())


def test_logprobs_equal_tandems_forward_over_turns(served) -> None:
    server, model = served
    outs, tokens = turns(server.url, [(PROMPT, 1)])
    first = outs[0]
    second_feed = [first.tokens[-1], STOP, 4, 104, 105, STOP, 5]
    outs, tokens = turns(server.url, [(PROMPT, 1), (second_feed, 2)])
    assert outs[0].tokens == first.tokens  # the same seed, the same draws
    got = torch.tensor(outs[0].logprobs + outs[1].logprobs, dtype=torch.float64)
    ref = reference_logprobs(model, tokens, len(PROMPT)).double()
    scored = torch.cat(
        [ref[: len(outs[0].tokens)], ref[-len(outs[1].tokens) :]]
    )  # the sampled tokens of both turns (the second turn's feed is not sampled)
    assert len(outs[1].tokens) >= 1 and len(got) == len(scored)
    assert float((got - scored).abs().max()) < 1e-5
    assert len(set(outs[0].tokens)) > 1  # real sampling, not a constant


def test_seeds_choose_the_draws(served) -> None:
    server, _ = served
    a = turns(server.url, [(PROMPT, 5)])[0][0].tokens
    b = turns(server.url, [(PROMPT, 5)])[0][0].tokens
    c = turns(server.url, [(PROMPT, 6)])[0][0].tokens
    assert a == b and a != c


def test_a_rejected_token_ends_the_turn(served) -> None:
    server, _ = served
    full = turns(server.url, [(PROMPT, 3)])[0][0]
    assert len(full.tokens) >= 4
    seen: list[int] = []

    def keep_going(tok: int) -> bool:
        seen.append(tok)
        return len(seen) < 3

    async def go():
        engine = engine_on(server.url)
        slot = await engine.acquire()
        out = await engine.generate(
            slot, list(PROMPT), torch.Generator().manual_seed(3), 24, keep_going
        )
        context = list(engine._context[slot])
        engine.release(slot)
        await engine.close()
        return out, context

    out, context = asyncio.run(go())
    assert out.tokens == full.tokens[:3] and out.logprobs == full.logprobs[:3]
    assert out.truncated
    assert context == PROMPT + out.tokens[:-1]  # the last token is fed by the next turn
    assert out.routes.shape == (len(PROMPT) + 2, 2, 2) and (out.routes == -1).all()


def test_tokens_carry_the_servers_weight_version(served) -> None:
    server, _ = served
    out = turns(server.url, [(PROMPT, 4)], initial_version=3)[0][0]
    assert set(out.versions) == {3} and out.min_version == out.max_version == 3  # "default"
    r = httpx.post(f"{server.url}/update_weight_version", json={"new_version": "12"})
    assert r.status_code == 200, r.text
    out = turns(server.url, [(PROMPT, 4)], initial_version=3)[0][0]
    assert set(out.versions) == {12} and out.max_version == 12


def test_many_episodes_at_once(served) -> None:
    server, _ = served

    async def one(engine: VllmEngine, seed: int):
        slot = await engine.acquire()
        try:
            return await engine.generate(
                slot, list(PROMPT), torch.Generator().manual_seed(seed), 24
            )
        finally:
            engine.release(slot)

    async def go():
        engine = engine_on(server.url)
        outs = await asyncio.gather(*(one(engine, s) for s in range(20)))
        await engine.close()
        return outs

    outs = asyncio.run(go())
    alone = turns(server.url, [(PROMPT, 7)])[0][0]
    assert outs[7].tokens == alone.tokens  # batched with 19 others, the same draws
    assert np.allclose(outs[7].logprobs, alone.logprobs, atol=1e-5)


def perturbed(model: MoETransformer, seed: int) -> MoETransformer:
    """A copy with about 3% of every tensor's elements changed (an RL step's delta)."""
    out = MoETransformer(model.config).eval()
    out.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in out.state_dict().values():
            mask = torch.rand(t.shape, generator=g) < 0.03
            t[mask] += 0.05 * torch.randn(t.shape, generator=g)[mask]
    return out


def test_updates_in_place_equal_a_fresh_server(served, tmp_path: Path) -> None:
    """Two versions pulled from a delta-sync store and applied in place: the server then
    samples and scores exactly as a server started on the last version's checkpoint."""
    server, model = served
    v1 = perturbed(model, 1)
    v2 = perturbed(v1, 2)
    store = tmp_path / "weights"
    publisher = Publisher(LocalStore(store))
    for version, m in enumerate((model, v1, v2)):
        publisher.publish(version, {k: v.detach() for k, v in m.state_dict().items()})
    publisher.close()

    async def update():
        async with httpx.AsyncClient(timeout=300) as client:
            weights = VllmWeights(client, server.url)
            await weights.follow(str(store), 0, hf_layout(model))
            first = await weights.update(1)
            second = await weights.update()
            again = await weights.update()
            return first, second, again

    plan = [(PROMPT, 21), ([PROMPT[0], *PROMPT[1:5]], 22)]
    at_start = turns(server.url, [plan[0]])[0][0]
    first, second, again = asyncio.run(update())
    print(f"update to 1: {first}\nupdate to 2: {second}")
    assert first is not None and first.version == 1
    assert second is not None and second.version == 2 and again is None
    assert second.downloaded_bytes > 0 and 0 < second.pause_s < 10
    updated = [turns(server.url, [p])[0][0] for p in plan]
    greedy_engine = msgspec.structs.replace(ENGINE, temperature=0.0)
    greedy = asyncio.run(_one_turn(server.url, greedy_engine))
    assert set(updated[0].versions) == {2}

    fresh_dir = save_hf(v2, tmp_path / "v2")
    fresh = VllmServer.start(vllm_python(), fresh_dir, ENGINE, log_path=tmp_path / "fresh.log")
    try:
        expected = [turns(fresh.url, [p])[0][0] for p in plan]
        expected_greedy = asyncio.run(_one_turn(fresh.url, greedy_engine))
    finally:
        fresh.close()
    for got, want in zip(updated, expected, strict=True):
        assert got.tokens == want.tokens
        assert got.logprobs == want.logprobs  # bit for bit (floats from the same bits)
    assert greedy.tokens == expected_greedy.tokens and greedy.logprobs == expected_greedy.logprobs
    assert updated[0].logprobs != at_start.logprobs  # the weights did change


async def _one_turn(url: str, config: EngineConfig):
    engine = VllmEngine([url], config, stop_id=STOP, vocab=266, model_vocab=266, route_shape=(2, 2))
    slot = await engine.acquire()
    out = await engine.generate(slot, list(PROMPT), torch.Generator().manual_seed(0), 24)
    engine.release(slot)
    await engine.close()
    return out


def test_a_dead_server_stops_the_engine(served) -> None:
    """Runs last in this module: it kills the module's server."""
    server, _ = served
    server.close()
    with pytest.raises(EngineStopped, match="did not answer"):
        turns(server.url, [(PROMPT, 1)])


def test_a_python_without_vllm_is_reported(tmp_path: Path) -> None:
    with pytest.raises(VllmServerFailed, match="No module named 'vllm'"):
        VllmServer.start(Path(sys.executable), tmp_path, ENGINE, log_path=tmp_path / "log")


def test_models_vllm_would_mis_serve_are_refused() -> None:
    check_servable(MODEL, cuda=False)
    with pytest.raises(ConfigValueError, match="shared expert"):
        check_servable(
            msgspec.structs.replace(MODEL, shared_expert_intermediate_size=32), cuda=True
        )
    with pytest.raises(ConfigValueError, match="head_dim 24"):
        check_servable(msgspec.structs.replace(MODEL, head_dim=24), cuda=False)
    check_servable(msgspec.structs.replace(MODEL, head_dim=24), cuda=True)


def test_config_checks_server_addresses() -> None:
    with pytest.raises(ConfigValueError, match="not an http"):
        VllmConfig(urls=["localhost:8000"])
    cfg = msgspec.convert({"engine": {"kind": "vllm"}}, RunConfig)
    assert cfg.engine.kind == "vllm" and cfg.engine.vllm.urls == []


def test_rl_refuses_the_vllm_engine_before_any_work() -> None:
    from tandem.orchestrator import check_rl_engine

    check_rl_engine(RunConfig())
    with pytest.raises(ConfigValueError, match="RL rollouts run on the embedded engine"):
        check_rl_engine(msgspec.convert({"engine": {"kind": "vllm"}}, RunConfig))
