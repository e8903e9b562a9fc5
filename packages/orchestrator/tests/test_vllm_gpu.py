"""vLLM on a CUDA GPU, aligned with the trainer: the experts of every token reported
(``--enable-return-routed-experts``) and replayed by the trainer (R3), and vLLM's
batch-invariant kernels (``VLLM_BATCH_INVARIANT=1``), which tandem sets on CUDA.

What is checked: every fed token's experts come back; the trainer routing freely picks
them; scored under R3 replay, the trainer's log-probs of vLLM's samples are within 1e-4
of vLLM's in fp32 (the goal is 0: the two use different kernels, so the figure is printed);
and a turn's log-probs are the same bits whether vLLM runs it alone or beside 15 others.
Needs a GPU and vLLM's CUDA environment (created with uv on first use, so the package index
must be reachable once).
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from vllm_helpers import ENGINE, MODEL, PROMPT, engine_on, turns

from tandem.moe_determinism import MoETransformer, batch_invariant, routing_agreement
from tandem.moe_determinism.model.hf import save_hf
from tandem.orchestrator.inference.vllm.environment import vllm_python
from tandem.orchestrator.inference.vllm.errors import VllmUnavailable
from tandem.orchestrator.inference.vllm.server import VllmServer
from tandem.orchestrator.training.collate import collate
from tandem.orchestrator.training.scoring import score
from tandem.orchestrator.wire import Sample

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def served_on_gpu(tmp_path_factory: pytest.TempPathFactory):
    try:
        python = vllm_python(cuda=True)
    except VllmUnavailable as e:
        pytest.skip(f"no vLLM CUDA environment could be made here: {e}")
    torch.manual_seed(11)
    model = MoETransformer(MODEL).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    directory = save_hf(model, tmp_path_factory.mktemp("vllm-gpu-policy"))
    server = VllmServer.start(
        python, directory, ENGINE, log_path=directory / "server.log", cuda=True
    )
    yield server, model
    server.close()


def _sample(out, tokens: list[int]) -> Sample:
    prompt = len(tokens) - len(out.tokens)
    return Sample(
        task_id="gpu",
        tokens=tokens,
        loss_mask=[0] * prompt + [1] * len(out.tokens),
        logprobs=[0.0] * prompt + list(out.logprobs),
        versions=[-1] * prompt + list(out.versions),
        routes=out.routes,
        reward=0.0,
        resolved=False,
        turns=1,
        termination="stop",
        min_version=out.min_version,
        max_version=out.max_version,
    )


def test_routes_come_back_and_r3_scores_vllms_samples(served_on_gpu) -> None:
    server, model = served_on_gpu
    outs, tokens = turns(server.url, [(PROMPT, 1)])
    out = outs[0]
    assert out.routes.shape == (len(tokens) - 1, len(MODEL.moe_layers), MODEL.num_experts_per_tok)
    assert (out.routes >= 0).all() and (out.routes < MODEL.num_experts).all()
    batch = collate([[_sample(out, tokens)]]).to("cuda")
    policy = MoETransformer(MODEL).eval().cuda()
    policy.load_state_dict(model.state_dict())
    with torch.no_grad(), batch_invariant():
        replayed, _, _ = score(policy, batch, "R3")
        _, free_ids, counts = score(policy, batch, "none")
    recorded = batch.extras["routes"][0, : counts[0]].long()
    agreement = routing_agreement(free_ids, recorded)
    mask = batch.loss_mask
    gap = (replayed[mask] - batch.rollout_logprobs[mask]).abs().max().item()
    print(f"routing agreement {agreement.per_decision:.4f}, log-prob gap under R3 {gap:.2e}")
    assert agreement.per_decision >= 0.99
    assert gap < 1e-4


def test_a_turns_logprobs_do_not_depend_on_its_batch(served_on_gpu) -> None:
    server, _ = served_on_gpu
    alone = turns(server.url, [(PROMPT, 3)])[0][0]

    async def beside_others():
        engine = engine_on(server.url)
        slots = [await engine.acquire() for _ in range(16)]
        feeds = [list(PROMPT)] + [[*PROMPT, 40 + i] * (1 + i % 3) for i in range(15)]
        seeds = [3, *range(100, 115)]
        outs = await asyncio.gather(
            *(
                engine.generate(s, f, torch.Generator().manual_seed(seed), ENGINE.max_new_tokens)
                for s, f, seed in zip(slots, feeds, seeds, strict=True)
            )
        )
        await engine.close()
        return outs[0]

    batched = asyncio.run(beside_others())
    assert batched.tokens == alone.tokens
    assert batched.logprobs == alone.logprobs  # the same bits (VLLM_BATCH_INVARIANT=1)
