"""Weight updates in place on vLLM for the other model families (slow: two server starts
each, about three minutes on 2 cores).

A Llama and a Mixtral policy written by `save_hf`, served by vLLM's CPU build, follow a
delta-sync stream through tandem's plugin (`hf_layout` names every checkpoint tensor from
the model's own state, whatever the family calls it) and then sample and score exactly as a
server started on the new version's checkpoint.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import msgspec
import pytest
import torch
from vllm_helpers import ENGINE, MODEL, PROMPT, perturbed, publish_versions, turns

from tandem.moe_determinism import MoEConfig, MoETransformer
from tandem.moe_determinism.model.hf import hf_layout, save_hf
from tandem.orchestrator.inference.vllm.environment import vllm_python
from tandem.orchestrator.inference.vllm.server import VllmServer
from tandem.orchestrator.inference.vllm.weights import VllmWeights

pytestmark = pytest.mark.slow
FAMILIES = {
    "llama": {"model_type": "llama", "intermediate_size": 96, "num_experts": 0},
    "mixtral": {"model_type": "mixtral", "shared_expert_intermediate_size": 0},
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_updates_in_place_equal_a_fresh_server(family: str, tmp_path: Path) -> None:
    cfg = msgspec.convert({**msgspec.to_builtins(MODEL), **FAMILIES[family]}, MoEConfig)
    torch.manual_seed(3)
    model = MoETransformer(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    v1 = perturbed(model, 1)
    store = tmp_path / "weights"
    publish_versions(store, model, v1)
    served = VllmServer.start(
        vllm_python(), save_hf(model, tmp_path / "v0"), ENGINE, log_path=tmp_path / "v0.log"
    )
    try:

        async def update() -> object:
            async with httpx.AsyncClient(timeout=300) as client:
                weights = VllmWeights(served.url, client=client)
                await weights.follow(str(store), 0, hf_layout(model))
                return await weights.update(1)

        before = turns(served.url, [(PROMPT, 5)])[0][0]
        applied = asyncio.run(update())
        after = turns(served.url, [(PROMPT, 5)])[0][0]
    finally:
        served.close()
    assert applied is not None and getattr(applied, "version", None) == 1
    fresh = VllmServer.start(
        vllm_python(), save_hf(v1, tmp_path / "v1"), ENGINE, log_path=tmp_path / "v1.log"
    )
    try:
        expected = turns(fresh.url, [(PROMPT, 5)])[0][0]
    finally:
        fresh.close()
    assert set(after.versions) == {1}
    assert after.tokens == expected.tokens
    assert after.logprobs == expected.logprobs  # bit for bit
    assert after.logprobs != before.logprobs  # the weights did change
