"""vLLM servers following a delta-sync stream in place: updates mid-turn and between turns
(equal to a fresh server on the last version), a short RL run, a server that dies and is
brought back. On the session's server (`vllm_served`), after `test_vllm_engine.py`; the
last test here stops it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import msgspec
import pytest
import torch
from vllm_helpers import (
    ENGINE,
    MODEL,
    PROMPT,
    engine_on,
    one_turn,
    perturbed,
    publish_versions,
    turns,
)

from tandem.moe_determinism import MoETransformer
from tandem.moe_determinism.model.hf import hf_layout, save_hf
from tandem.orchestrator.config import RunConfig, VllmConfig
from tandem.orchestrator.inference.vllm.engine import VllmEngine
from tandem.orchestrator.inference.vllm.environment import vllm_python
from tandem.orchestrator.inference.vllm.server import VllmServer
from tandem.orchestrator.inference.vllm.weights import VllmWeights
from tandem.orchestrator.protocols import EngineStopped

PACE_S = 0.05  # a paced server step sleeps this long first (`tandem_pace`)


def test_an_update_arriving_mid_turn(vllm_served, tmp_path: Path) -> None:
    """A version applied while a turn decodes (streamed: the server is paused at its first
    tokens, then updated): tokens before the update carry the old version and are those
    the old weights sample alone; tokens after it carry the new one. The server's steps
    are paced while the test waits for the first tokens, so that the rest of the turn
    cannot finish before the pause however loaded the machine is."""
    servers, model = vllm_served
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
            await weights.rpc("tandem_pace", str(PACE_S))  # the rest takes n * PACE_S at least
            try:
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
                            await weights.rpc("tandem_pace", "0")
                            update = await weights.update(1)
            finally:
                await weights.rpc("tandem_pace", "0")
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


def test_rl_steps_train_and_publish_on_vllm(vllm_served, tmp_path: Path) -> None:
    """A short async RL run whose rollouts play on the vLLM server (given by URL): every
    step trains and publishes, the server follows the stream, and the trainer measures
    the gap between vLLM's log-probs and its own."""
    from rl_helpers import ENV, parity

    from tandem.orchestrator import reinforce
    from tandem.orchestrator.config import RLConfig, RunSettings, TaskConfig, TrainerConfig
    from tandem.orchestrator.rl.hooks import RunHooks

    servers, model = vllm_served
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
    assert config.trainer.replay == "R3"  # asked for; the samples carry no routes here
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
    assert {r["trainer_replay"] for r in records} == {"R2"}  # so the trainer's own routes
    gaps = [r["mismatch_max_abs"] for r in records if r.get("mismatch_max_abs") is not None]
    assert gaps and max(gaps) < 1e-3  # fp32 vLLM against the trainer's batch-invariant ops


def test_a_server_that_dies_is_restarted_and_the_group_played_again(
    vllm_served, tmp_path: Path
) -> None:
    from rl_helpers import ENV

    from tandem.orchestrator.config import EpisodeConfig, TaskConfig
    from tandem.orchestrator.inference.chat_format import ChatFormat
    from tandem.orchestrator.protocols import WorkerLost
    from tandem.orchestrator.rollout.tasks import TaskSource
    from tandem.orchestrator.rollout.vllm import VllmRollouts

    servers, model = vllm_served
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


def test_updates_in_place_equal_a_fresh_server(vllm_served, tmp_path: Path) -> None:
    """Two versions pulled from a delta-sync store and applied in place: the server then
    samples and scores exactly as a server started on the last version's checkpoint."""
    servers, model = vllm_served
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
    greedy = asyncio.run(one_turn(url, greedy_engine))
    assert set(updated[0].versions) == {2}

    fresh_dir = save_hf(v2, tmp_path / "v2")
    fresh = VllmServer.start(vllm_python(), fresh_dir, ENGINE, log_path=tmp_path / "fresh.log")
    try:
        expected = [turns(fresh.url, [p])[0][0] for p in plan]
        expected_greedy = asyncio.run(one_turn(fresh.url, greedy_engine))
    finally:
        fresh.close()
    for got, want in zip(updated, expected, strict=True):
        assert got.tokens == want.tokens
        assert got.logprobs == want.logprobs  # bit for bit (floats from the same bits)
    assert greedy.tokens == expected_greedy.tokens and greedy.logprobs == expected_greedy.logprobs
    assert updated[0].logprobs != at_start.logprobs  # the weights did change


def test_a_dead_server_stops_the_engine(vllm_served) -> None:
    """Runs last in this module: it stops the module's server."""
    servers, _ = vllm_served
    url = servers.urls[0]
    servers.close()
    with pytest.raises(EngineStopped, match="did not answer"):
        turns(url, [(PROMPT, 1)])
