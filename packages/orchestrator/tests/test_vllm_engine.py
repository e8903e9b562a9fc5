"""vLLM as the engine: a real vLLM server (its own environment, created by tandem with uv on
first use and cached) serving a tiny tandem MoE, driven through the `Engine` protocol.

One server for the session (`vllm_served`). Its log-probs are checked against tandem's own
forward of the same tokens, computed here independently. These tests run before the ones
that change the server's weights (`test_vllm_updates.py`).
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
from vllm_helpers import ENGINE, MODEL, PROMPT, STOP, engine_on, reference_logprobs, turns

from tandem.moe_determinism import MoEConfig, MoETransformer
from tandem.moe_determinism.model.hf import save_hf
from tandem.orchestrator.config import ConfigValueError, RunConfig, VllmConfig
from tandem.orchestrator.inference.vllm.engine import VllmEngine
from tandem.orchestrator.inference.vllm.environment import vllm_python
from tandem.orchestrator.inference.vllm.errors import VllmRequestRefused, VllmServerFailed
from tandem.orchestrator.inference.vllm.server import VllmServer
from tandem.orchestrator.inference.vllm.serving import check_servable


def test_logprobs_equal_tandems_forward_over_turns(vllm_served) -> None:
    servers, model = vllm_served
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


def test_seeds_choose_the_draws(vllm_served) -> None:
    servers, _ = vllm_served
    url = servers.urls[0]
    a = turns(url, [(PROMPT, 5)])[0][0].tokens
    b = turns(url, [(PROMPT, 5)])[0][0].tokens
    c = turns(url, [(PROMPT, 6)])[0][0].tokens
    assert a == b and a != c


def test_a_rejected_token_ends_the_turn(vllm_served) -> None:
    servers, _ = vllm_served
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


def test_tokens_carry_the_servers_weight_version(vllm_served) -> None:
    servers, _ = vllm_served
    url = servers.urls[0]
    out = turns(url, [(PROMPT, 4)], initial_version=3)[0][0]
    assert set(out.versions) == {3} and out.min_version == out.max_version == 3  # "default"
    r = httpx.post(f"{url}/update_weight_version", json={"new_version": "12"})
    assert r.status_code == 200, r.text
    out = turns(url, [(PROMPT, 4)], initial_version=3)[0][0]
    assert set(out.versions) == {12} and out.max_version == 12


def test_many_episodes_at_once(vllm_served) -> None:
    servers, _ = vllm_served
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


def test_bad_requests_are_refused_and_the_server_keeps_serving(vllm_served) -> None:
    servers, _ = vllm_served
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


def test_a_python_without_vllm_is_reported(tmp_path: Path) -> None:
    with pytest.raises(VllmServerFailed, match="No module named 'vllm'"):
        VllmServer.start(Path(sys.executable), tmp_path, ENGINE, log_path=tmp_path / "log")


def test_models_vllm_cannot_serve_are_refused() -> None:
    check_servable(MODEL, cuda=False)
    check_servable(msgspec.structs.replace(MODEL, shared_expert_intermediate_size=32), cuda=False)
    with pytest.raises(ConfigValueError, match="head_dim 24"):
        check_servable(msgspec.structs.replace(MODEL, head_dim=24), cuda=False)
    check_servable(msgspec.structs.replace(MODEL, head_dim=24), cuda=True)
    deepseek = msgspec.convert({**msgspec.to_builtins(MODEL), **DEEPSEEK}, MoEConfig)
    with pytest.raises(ConfigValueError, match="multi-head latent attention"):
        check_servable(deepseek, cuda=False)
    check_servable(deepseek, cuda=True)


def test_config_checks_server_addresses() -> None:
    with pytest.raises(ConfigValueError, match="not an http"):
        VllmConfig(urls=["localhost:8000"])
    cfg = msgspec.convert({"engine": {"kind": "vllm"}}, RunConfig)
    assert cfg.engine.kind == "vllm" and cfg.engine.vllm.urls == []


def test_vllm_servers_given_by_url_are_refused_on_ray_before_any_work() -> None:
    from tandem.orchestrator import check_rl_engine

    check_rl_engine(RunConfig())
    check_rl_engine(msgspec.convert({"engine": {"kind": "vllm"}}, RunConfig))
    ray = {"engine": {"kind": "vllm"}, "rl": {"backend": "ray"}}
    check_rl_engine(msgspec.convert(ray, RunConfig))  # a server per rollout actor
    ray["engine"]["vllm"] = {"urls": ["http://127.0.0.1:8000"]}
    with pytest.raises(ConfigValueError, match="each rollout actor starts and updates"):
        check_rl_engine(msgspec.convert(ray, RunConfig))


DEEPSEEK = {
    "model_type": "deepseek_v3",
    "num_key_value_heads": 4,
    "num_experts": 8,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1,
    "intermediate_size": 96,
    "shared_expert_intermediate_size": 48,
    # vLLM's CPU MLA decode kernel takes only DeepSeek-V3's own widths: latent 512, rotary 64
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 64,
    "v_head_dim": 32,
    "head_dim": 64,
    "rope_interleave": True,
}
VARIANTS = {
    "tied-embeddings": {"tie_word_embeddings": True},
    "no-topk-norm": {"norm_topk_prob": False},
    "dense-first-layer": {"mlp_only_layers": [0], "intermediate_size": 96},
    "every-other-moe": {"decoder_sparse_step": 2, "intermediate_size": 96},
    "dense-qwen3": {"model_type": "qwen3", "intermediate_size": 96},
    "no-shared-expert": {"shared_expert_intermediate_size": 0},
    # the other families (`moe_determinism.model.families`)
    "llama": {"model_type": "llama", "intermediate_size": 96, "num_experts": 0},
    "llama-llama3-rope-bias": {
        "model_type": "llama",
        "intermediate_size": 96,
        "num_experts": 0,
        "attention_bias": True,
        "rope_scaling": {"original_max_position_embeddings": 64},
    },
    "mistral": {"model_type": "mistral", "intermediate_size": 96, "num_experts": 0},
    "qwen2": {
        "model_type": "qwen2",
        "intermediate_size": 96,
        "num_experts": 0,
        "num_attention_heads": 2,  # its head width is hidden_size / heads (32)
        "num_key_value_heads": 1,
    },
    "mixtral": {"model_type": "mixtral", "shared_expert_intermediate_size": 0},
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_supported_layout_is_served_as_tandem_computes_it(
    variant: str, tmp_path: Path
) -> None:
    """Each `MoEConfig` variant tandem writes, loaded by vLLM: log-probs within 1e-5 of
    tandem's forward (a server start each: about a minute on two cores)."""
    cfg = msgspec.convert({**msgspec.to_builtins(MODEL), **VARIANTS[variant]}, MoEConfig)
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


def test_a_long_episode_summarises_on_the_server_and_each_segment_is_tandems(vllm_served) -> None:
    """Compaction on the vLLM engine: the same rollout code as the embedded engine's; every
    context is a fresh slot (its token history dropped), and each segment's log-probs are
    within 1e-5 of tandem's own forward over that segment."""
    from tandem.agent_env import EnvConfig, generate_tasks
    from tandem.orchestrator.compaction_config import CompactionConfig
    from tandem.orchestrator.inference.chat_format import ChatFormat
    from tandem.orchestrator.rollout.episode import episode_generator, run_token_episode

    servers, model = vllm_served
    chat = ChatFormat()
    task = generate_tasks(seed=3, n=1, functions=["gcd"], functions_per_repo=1)[0]
    env = EnvConfig(max_turns=6, allow_unsandboxed=True, system_prompt="Fix it.")
    compaction = CompactionConfig(
        mode="summary", trigger=0.85, summary_max_tokens=24, instruction="Summarise.",
        keep_last_observation=False,
    )  # fmt: skip

    async def go():
        engine = VllmEngine(
            servers.urls, ENGINE, stop_id=chat.end_id, vocab=266, model_vocab=266,
            route_shape=(len(MODEL.moe_layers), MODEL.num_experts_per_tok),
            moe_layers=MODEL.moe_layers,
        )  # fmt: skip
        try:
            samples = await asyncio.gather(
                *(
                    run_token_episode(
                        engine, chat, task, env, max_new_tokens=24, max_observation_chars=64,
                        generator=episode_generator(9, j), stop_malformed=False,
                        compaction=compaction,
                    )
                    for j in range(2)
                )
            )  # fmt: skip
            return samples, dict(engine._context)
        finally:
            await engine.close()

    samples, contexts = asyncio.run(go())
    assert not contexts  # every slot's history was dropped
    segments = [seg for s in samples for seg in s.segments()]
    assert len(segments) >= 4 and all(s.compactions for s in samples)
    for seg in segments:
        assert seg.routes.shape[0] == len(seg.tokens) - 1
        ref = reference_logprobs(model, seg.tokens, 1).double()
        sampled = [i for i, m in enumerate(seg.loss_mask) if m]
        got = torch.tensor([seg.logprobs[i] for i in sampled], dtype=torch.float64)
        assert float((got - ref[[i - 1 for i in sampled]]).abs().max()) < 1e-5
