"""vLLM as the engine: a real vLLM server (its own environment, created by tandem with uv on
first use and cached) serving a tiny tandem MoE, driven through the `Engine` protocol.

One server for the module (a start takes tens of seconds on two cores). Its log-probs are
checked against tandem's own forward of the same tokens, computed here independently.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
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
from tandem.orchestrator.inference.vllm.errors import VllmRequestRefused, VllmServerFailed
from tandem.orchestrator.inference.vllm.server import VllmServer
from tandem.orchestrator.inference.vllm.serving import VllmServers, check_servable
from tandem.orchestrator.inference.vllm.weights import VllmWeights
from tandem.orchestrator.protocols import EngineStopped

MODEL = MoEConfig(
    vocab_size=266,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # vLLM's CPU attention has no head size below 32
    moe_intermediate_size=48,  # padded to 64 by vLLM's CPU experts
    num_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=1024,
)
ENGINE = EngineConfig(kind="vllm", max_slots=8, max_len=512, max_new_tokens=24)
STOP = 7
PROMPT = [1, 3, 70, 105, 120, 32, 116, 104, 101, 32, 98, 117, 103, 7, 4, 104, 105, 7, 5]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    """(servers, model): a random tiny MoE written by `save_hf` and a server on it (one
    tandem can restart)."""
    torch.manual_seed(11)
    model = MoETransformer(MODEL).eval()
    with torch.no_grad():  # larger logits than the default init: sampled tokens vary more
        model.lm_head.weight.mul_(20)
    directory = save_hf(model, tmp_path_factory.mktemp("policy"))
    python = vllm_python()
    servers = VllmServers(
        [], lambda: VllmServer.start(python, directory, ENGINE, log_path=directory / "server.log")
    )
    yield servers, model
    servers.close()


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
    servers, model = served
    url = servers.urls[0]
    outs, tokens = turns(url, [(PROMPT, 1)])
    first = outs[0]
    second_feed = [first.tokens[-1], STOP, 4, 104, 105, STOP, 5]
    outs, tokens = turns(url, [(PROMPT, 1), (second_feed, 2)])
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
    servers, _ = served
    url = servers.urls[0]
    a = turns(url, [(PROMPT, 5)])[0][0].tokens
    b = turns(url, [(PROMPT, 5)])[0][0].tokens
    c = turns(url, [(PROMPT, 6)])[0][0].tokens
    assert a == b and a != c


def test_a_rejected_token_ends_the_turn(served) -> None:
    servers, _ = served
    url = servers.urls[0]
    full = turns(url, [(PROMPT, 3)])[0][0]
    assert len(full.tokens) >= 4
    seen: list[int] = []

    def keep_going(tok: int) -> bool:
        seen.append(tok)
        return len(seen) < 3

    async def go():
        engine = engine_on(url)
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
    servers, _ = served
    url = servers.urls[0]
    out = turns(url, [(PROMPT, 4)], initial_version=3)[0][0]
    assert set(out.versions) == {3} and out.min_version == out.max_version == 3  # "default"
    r = httpx.post(f"{url}/update_weight_version", json={"new_version": "12"})
    assert r.status_code == 200, r.text
    out = turns(url, [(PROMPT, 4)], initial_version=3)[0][0]
    assert set(out.versions) == {12} and out.max_version == 12


def test_many_episodes_at_once(served) -> None:
    servers, _ = served
    url = servers.urls[0]

    async def one(engine: VllmEngine, seed: int):
        slot = await engine.acquire()
        try:
            return await engine.generate(
                slot, list(PROMPT), torch.Generator().manual_seed(seed), 24
            )
        finally:
            engine.release(slot)

    async def go():
        engine = engine_on(url)
        outs = await asyncio.gather(*(one(engine, s) for s in range(20)))
        await engine.close()
        return outs

    outs = asyncio.run(go())
    alone = turns(url, [(PROMPT, 7)])[0][0]
    assert outs[7].tokens == alone.tokens  # batched with 19 others, the same draws
    assert np.allclose(outs[7].logprobs, alone.logprobs, atol=1e-5)


def publish_versions(store: Path, *models: MoETransformer) -> None:
    """Versions 0, 1, ... of ``models`` into a delta-sync store, as the trainer publishes."""
    publisher = Publisher(LocalStore(store))
    for version, m in enumerate(models):
        publisher.publish(version, {k: v.detach() for k, v in m.state_dict().items()})
    publisher.close()


def test_bad_requests_are_refused_and_the_server_keeps_serving(served) -> None:
    servers, _ = served
    url = servers.urls[0]
    with pytest.raises(ValueError, match=r"token ids \[99999\] are outside"):
        turns(url, [([*PROMPT, 99_999], 1)])  # vLLM's engine would die on it
    malformed = {"token_ids": PROMPT, "sampling_params": {"temperature": -1.0}}

    async def send():
        engine = engine_on(url)
        try:
            return await engine._post(url, malformed)
        finally:
            await engine.close()

    with pytest.raises(VllmRequestRefused, match=r"HTTP 4\d\d"):
        asyncio.run(send())
    assert turns(url, [(PROMPT, 1)])[0][0].tokens  # still serving


def test_an_update_arriving_mid_turn(served, tmp_path: Path) -> None:
    """A version applied while a turn decodes (streamed: the server is paused at its first
    tokens, then updated): tokens before the update carry the old version and are those
    the old weights sample alone; tokens after it carry the new one."""
    servers, model = served
    url = servers.urls[0]
    store = tmp_path / "weights"
    publish_versions(store, model, perturbed(model, 5))
    n = 480
    body = {
        "token_ids": PROMPT,
        "sampling_params": {"temperature": 1.0, "max_tokens": n, "seed": 9, "logprobs": 0},
        "stream": True,
    }

    async def go():
        async with httpx.AsyncClient(timeout=300) as client:
            weights = VllmWeights(url, client=client)
            await weights.follow(str(store), 0, hf_layout(model))
            await weights.rpc("tandem_prepare", "1")  # once ahead: the worker's first decode
            while (await weights.rpc("tandem_status"))[0]["preparing"]:  # compiles its kernels
                await asyncio.sleep(0.05)
            t0 = time.perf_counter()
            r = await client.post(f"{url}/inference/v1/generate", json={**body, "stream": False})
            alone = r.json()["choices"][0]["token_ids"]  # version 0 alone
            print(f"{n} tokens alone in {time.perf_counter() - t0:.2f} s")
            tokens: list[int] = []
            spans: list[dict] = []
            update = None
            # other long turns at once make each decoding step slower: room for the update
            others = [
                asyncio.create_task(
                    client.post(
                        f"{url}/inference/v1/generate",
                        json={**body, "stream": False, "token_ids": [*PROMPT, i]},
                    )
                )
                for i in range(12)
            ]
            async with client.stream("POST", f"{url}/inference/v1/generate", json=body) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    choice = json.loads(line[6:])["choices"][0]
                    tokens += choice.get("token_ids") or []
                    spans = choice.get("weight_versions") or spans
                    if update is None and tokens:
                        # freeze the turn where it is, then update (the update resumes it)
                        await client.post(f"{url}/pause", params={"mode": "keep"})
                        update = await weights.update(1)
            await asyncio.gather(*others)
            return alone, update, tokens, spans

    alone, update, tokens, spans = asyncio.run(go())
    assert update is not None and update.version == 1 and len(tokens) == n
    versions = [s["version"] for s in spans]
    print(f"mid-turn update: {update}, spans {spans}")
    assert versions == ["0", "1"] and spans[0]["start"] == 0 and spans[-1]["end"] == n
    switch = spans[1]["start"]
    assert 1 <= switch < n, "the update must land inside the turn"
    assert tokens[:switch] == alone[:switch]
    assert tokens[switch:] != alone[switch:]


def test_rl_steps_train_and_publish_on_vllm(served, tmp_path: Path) -> None:
    """A short async RL run whose rollouts play on the vLLM server (given by URL): every
    step trains and publishes, the server follows the stream, and the trainer measures
    the gap between vLLM's log-probs and its own."""
    from rl_helpers import ENV, parity

    from tandem.orchestrator import reinforce
    from tandem.orchestrator.config import RLConfig, RunSettings, TaskConfig, TrainerConfig
    from tandem.orchestrator.rl.hooks import RunHooks

    servers, model = served
    engine = msgspec.structs.replace(
        ENGINE, max_new_tokens=8, vllm=VllmConfig(urls=[servers.urls[0]])
    )
    config = RunConfig(
        run=RunSettings(name="vllm-rl", output_dir=str(tmp_path)),
        model=MODEL,
        tasks=TaskConfig(),
        env=ENV,
        engine=engine,
        trainer=TrainerConfig(lr=1e-2, routing_check_rows=2),
        rl=RLConfig(steps=3, group_size=4, groups_per_step=2, checkpoint_every=3),
    )
    assert config.trainer.replay == "R2"  # vLLM reports no routes to replay here
    policy = MoETransformer(MODEL).eval()
    policy.load_state_dict(model.state_dict())
    published: list[int] = []
    summary = reinforce(
        policy,
        config,
        run_dir=tmp_path / "rl",
        task_offset=0,
        hooks=RunHooks(reward=parity, on_publish=lambda v, _: published.append(v)),
    )
    assert summary.steps_done == 3 and summary.policy_version == 3
    assert published == [1, 2, 3]
    assert summary.last_metrics["engine_version"] >= 1  # the server followed the stream
    assert summary.pause_s and max(summary.pause_s) < 10
    assert not any(k.startswith("routing_agreement") for k in summary.last_metrics)
    records = [json.loads(line) for line in (tmp_path / "rl" / "metrics.jsonl").open()]
    gaps = [r["mismatch_max_abs"] for r in records if r.get("mismatch_max_abs") is not None]
    assert gaps and max(gaps) < 1e-3  # fp32 vLLM against the trainer's batch-invariant ops


def test_a_server_that_dies_is_restarted_and_the_group_played_again(served, tmp_path: Path) -> None:
    from rl_helpers import ENV

    from tandem.orchestrator.config import EpisodeConfig, TaskConfig
    from tandem.orchestrator.inference.chat_format import ChatFormat
    from tandem.orchestrator.protocols import WorkerLost
    from tandem.orchestrator.rollout.tasks import TaskSource
    from tandem.orchestrator.rollout.vllm import VllmRollouts

    servers, model = served
    store = tmp_path / "weights"
    v1 = perturbed(model, 7)
    publish_versions(store, model, v1)
    old_url = servers.urls[0]
    chat = ChatFormat()
    rollouts = VllmRollouts(
        VllmEngine(
            servers.urls,
            ENGINE,
            stop_id=chat.end_id,
            vocab=266,
            model_vocab=266,
            route_shape=(2, 2),
        ),
        str(store),
        hf_layout(model),
        0,
        TaskSource(TaskConfig(), 1),
        chat=chat,
        env=ENV,
        episode=EpisodeConfig(),
        engine_cfg=ENGINE,
        seed=0,
        group_size=3,
        servers=servers,
    )

    async def go():
        await rollouts.start(follow=False)
        await rollouts.sync_to(1)
        before = await rollouts.play(0)
        os.killpg(servers.server.process.pid, signal.SIGKILL)  # the server and its workers
        with pytest.raises(WorkerLost, match="vLLM server failed"):
            await rollouts.play(1)
        again = await rollouts.play(1)
        stats = await rollouts.stats()
        await rollouts.close()
        return before, again, stats

    before, again, stats = asyncio.run(go())
    assert len(before.samples) == 3 and len(again.samples) == 3
    assert rollouts.restarts == 1 and servers.urls[0] != old_url
    assert stats.engine_version == 1  # restarted on version 0, then updated to the latest
    assert all(set(v for v in s.versions if v >= 0) == {1} for s in again.samples)


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
    servers, model = served
    url = servers.urls[0]
    v1 = perturbed(model, 1)
    v2 = perturbed(v1, 2)
    store = tmp_path / "weights"
    publish_versions(store, model, v1, v2)
    plan = [(PROMPT, 21), ([PROMPT[0], *PROMPT[1:5]], 22)]

    async def follow_then_update():
        async with httpx.AsyncClient(timeout=300) as client:
            weights = VllmWeights(url, client=client)
            await weights.follow(str(store), 0, hf_layout(model))  # loads version 0 now
            engine = engine_on(url)
            slot = await engine.acquire()
            start = await engine.generate(slot, list(PROMPT), torch.Generator().manual_seed(21), 24)
            engine.release(slot)
            await engine.close()
            first = await weights.update(1)
            second = await weights.update()
            again = await weights.update()
            return start, first, second, again

    at_start, first, second, again = asyncio.run(follow_then_update())
    print(f"update to 1: {first}\nupdate to 2: {second}")
    assert first is not None and first.version == 1
    assert second is not None and second.version == 2 and again is None
    assert second.downloaded_bytes > 0 and 0 < second.pause_s < 10
    updated = [turns(url, [p])[0][0] for p in plan]
    greedy_engine = msgspec.structs.replace(ENGINE, temperature=0.0)
    greedy = asyncio.run(_one_turn(url, greedy_engine))
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
    """Runs last in this module: it stops the module's server."""
    servers, _ = served
    url = servers.urls[0]
    servers.close()
    with pytest.raises(EngineStopped, match="did not answer"):
        turns(url, [(PROMPT, 1)])


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


def test_rl_on_vllm_with_ray_is_refused_before_any_work() -> None:
    from tandem.orchestrator import check_rl_engine

    check_rl_engine(RunConfig())
    check_rl_engine(msgspec.convert({"engine": {"kind": "vllm"}}, RunConfig))
    ray = {"engine": {"kind": "vllm"}, "rl": {"backend": "ray"}}
    with pytest.raises(ConfigValueError, match="vLLM rollouts run on the local backend"):
        check_rl_engine(msgspec.convert(ray, RunConfig))


VARIANTS = {
    "tied-embeddings": {"tie_word_embeddings": True},
    "no-topk-norm": {"norm_topk_prob": False},
    "dense-first-layer": {"mlp_only_layers": [0], "intermediate_size": 96},
    "every-other-moe": {"decoder_sparse_step": 2, "intermediate_size": 96},
    "dense-qwen3": {"model_type": "qwen3", "intermediate_size": 96},
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_supported_layout_is_served_as_tandem_computes_it(
    variant: str, tmp_path: Path
) -> None:
    """Each `MoEConfig` variant tandem writes, loaded by vLLM: log-probs within 1e-5 of
    tandem's forward (a server start each: about a minute on two cores)."""
    cfg = msgspec.structs.replace(MODEL, **VARIANTS[variant])
    torch.manual_seed(5)
    model = MoETransformer(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    check_servable(cfg, cuda=False)
    directory = save_hf(model, tmp_path / "policy")
    server = VllmServer.start(vllm_python(), directory, ENGINE, log_path=tmp_path / "log")
    try:
        outs, tokens = turns(server.url, [(PROMPT, 1)])
    finally:
        server.close()
    got = torch.tensor(outs[0].logprobs, dtype=torch.float64)
    ref = reference_logprobs(model, tokens, len(PROMPT)).double()
    assert len(got) == len(ref) and float((got - ref).abs().max()) < 1e-5
