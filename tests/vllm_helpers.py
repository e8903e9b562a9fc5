"""Shared pieces of the vLLM engine tests: a tiny servable MoE, the engine on a server,
turns played on one slot, tandem's own log-probs to compare with, and weight versions
published as the trainer publishes them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import torch

from tandem.delta_sync import LocalStore, Publisher
from tandem.moe_determinism import MoEConfig, MoETransformer
from tandem.moe_determinism.logprobs import sampling_logits, target_logprobs
from tandem.orchestrator.config import EngineConfig
from tandem.orchestrator.inference.vllm.engine import VllmEngine
from tandem.orchestrator.inference.vllm.server import VllmServer

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
    shared_expert_intermediate_size=32,  # written with the gate vLLM's Qwen3-MoE applies
    max_position_embeddings=1024,
)
ENGINE = EngineConfig(kind="vllm", max_slots=8, max_len=512, max_new_tokens=24)
SERVER_SIDE = Path(__file__).parent / "vllm_server_side"
# the tests' own server: tandem's extension with a pace (`paced_extension.py`)
PACED_ENGINE = msgspec.structs.replace(
    ENGINE,
    vllm=msgspec.structs.replace(
        ENGINE.vllm,
        extra_args=["--worker-extension-cls", "paced_extension.PacedDeltaSyncExtension"],
    ),
)
STOP = 7
PROMPT = [1, 3, 70, 105, 120, 32, 116, 104, 101, 32, 98, 117, 103, 7, 4, 104, 105, 7, 5]


def start_test_server(python: Path, directory: Path) -> VllmServer:
    """The tests' server on the checkpoint in ``directory``: `PACED_ENGINE`, with only
    `SERVER_SIDE` on its PYTHONPATH."""
    return VllmServer.start(
        python,
        directory,
        PACED_ENGINE,
        log_path=directory / "server.log",
        extra_env={"PYTHONPATH": str(SERVER_SIDE)},
    )


def engine_on(url: str, **kw: object) -> VllmEngine:
    return VllmEngine(
        [url],
        ENGINE,
        stop_id=STOP,
        vocab=266,
        model_vocab=266,
        route_shape=(len(MODEL.moe_layers), MODEL.num_experts_per_tok),
        moe_layers=MODEL.moe_layers,
        **kw,
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


def publish_versions(store: Path, *models: MoETransformer) -> None:
    """Versions 0, 1, ... of ``models`` into a delta-sync store, as the trainer publishes."""
    publisher = Publisher(LocalStore(store))
    for version, m in enumerate(models):
        publisher.publish(version, {k: v.detach() for k, v in m.state_dict().items()})
    publisher.close()


async def one_turn(url: str, config: EngineConfig):
    engine = VllmEngine([url], config, stop_id=STOP, vocab=266, model_vocab=266, route_shape=(2, 2))
    slot = await engine.acquire()
    out = await engine.generate(slot, list(PROMPT), torch.Generator().manual_seed(0), 24)
    engine.release(slot)
    await engine.close()
    return out
