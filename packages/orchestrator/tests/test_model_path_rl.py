"""A short RL run on Hugging Face checkpoints built here: dense Qwen3 (no routers) and
Qwen3-MoE with a dense layer (routes for the MoE layers only, replayed to the trainer).

Per step the engine's weights equal the trainer's bit for bit after each weight pull, and
where the trainer re-scores the rollouts the log-probs agree bit for bit (replayed routes
included). The reward is a parity of the generated tokens, so a random policy gets groups
with different rewards.

A checkpoint with its own tokenizer and chat template (a tiny Qwen3-MoE whose embedding has
half again the rows of its tokenizer, trained here, with the Qwen3-style template of
``data/``, as real checkpoints pad theirs) renders prompts with the template, parses turns
as ``<tool_call>`` blocks, never samples a padded id, and the trainer scores exactly the ids
the engine sampled with the same log-probs, bit for bit.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import torch

from tandem.agent_env import EnvConfig, tool_schemas
from tandem.moe_determinism import batch_invariant, load_hf
from tandem.orchestrator import RunConfig, reinforce
from tandem.orchestrator.artifacts.metrics import read_metrics
from tandem.orchestrator.config import ConfigValueError
from tandem.orchestrator.inference.chat_format import ChatFormat
from tandem.orchestrator.inference.formats import chat_format_for
from tandem.orchestrator.inference.template_chat import TemplateChatFormat
from tandem.orchestrator.inference.tokenizer import ByteTokenizer
from tandem.orchestrator.policy import build_model, load_policy, save_policy
from tandem.orchestrator.rl.hooks import RunHooks
from tandem.orchestrator.training.collate import collate
from tandem.orchestrator.training.scoring import score
from tandem.orchestrator.training.weights import weights_equal
from tandem.orchestrator.wire import Sample

SHAPES = dict(
    vocab_size=266,  # the byte tokenizer's
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
)


def _checkpoint(kind: str, path: Path, vocab_size: int = 266) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    shapes = {**SHAPES, "vocab_size": vocab_size}
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**shapes))
    else:
        moe = dict(moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2)
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**shapes, **moe, mlp_only_layers=[0]))
    model.save_pretrained(path)
    return path


def _config(
    ckpt: Path, out: Path, *, max_turns: int = 1, max_new_tokens: int = 6, max_len: int = 1024
) -> RunConfig:
    return msgspec.convert(
        {
            "run": {"output_dir": str(out), "name": "rl"},
            "model": {"path": str(ckpt), "kv_split_size": 16},
            "env": msgspec.to_builtins(
                EnvConfig(max_turns=max_turns, allow_unsandboxed=True, episode_wall_s=120.0)
            ),
            "tasks": {"functions": ["gcd"], "functions_per_repo": 1},
            "engine": {"max_slots": 4, "max_len": max_len, "max_new_tokens": max_new_tokens},
            "trainer": {"lr": 1e-2, "routing_check_rows": 2},
            "rl": {
                "mode": "sync",
                "steps": 2,
                "group_size": 2,
                "groups_per_step": 1,
                "rollout_workers": 1,
                "checkpoint_every": 2,
                "torch_threads": 1,
            },
        },
        RunConfig,
    )


def _weight_hooks(
    reward: Callable[[Sample], float],
) -> tuple[RunHooks, dict[int, dict[str, torch.Tensor]], dict[int, bool]]:
    """Hooks recording each published version and whether the engine's weights equal it."""
    published: dict[int, dict[str, torch.Tensor]] = {}
    applied: dict[int, bool] = {}
    hooks = RunHooks(
        on_publish=lambda v, s: published.__setitem__(v, {k: t.clone() for k, t in s.items()}),
        on_engine_update=lambda v, s: applied.__setitem__(v, weights_equal(s, published[v])),
        reward=reward,
    )
    return hooks, published, applied


def _parity(sample: Sample) -> float:
    return float(sum(sample.tokens[-len(sample.tokens) // 3 :]) % 2)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_rl_steps_on_a_checkpoint_keep_engine_and_trainer_equal(kind: str, tmp_path: Path) -> None:
    ckpt = _checkpoint(kind, tmp_path / "ckpt")
    config = _config(ckpt, tmp_path)
    hooks, published, applied = _weight_hooks(_parity)
    policy = build_model(config.model, ByteTokenizer())
    summary = reinforce(policy, config, run_dir=tmp_path / "rl_dir", task_offset=0, hooks=hooks)
    assert summary.steps_done == 2 and sorted(published) == [1, 2]
    assert applied and all(applied.values()), applied
    records = read_metrics(tmp_path / "rl_dir" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    checked = [r for r in records if r.get("mismatch_tokens")]
    assert checked, "the trainer re-scored no rollout tokens"
    assert all(r["mismatch_max_abs"] == 0.0 for r in checked)
    if kind == "qwen3_moe":
        assert all(r["routing_agreement_replay"] == 1.0 for r in records)
    else:  # no routers: nothing to compare, and no NaN reported
        assert all("routing_agreement_replay" not in r for r in records)


PADDED_VOCAB = 768  # embedding rows; the tokenizer has about two thirds as many ids


@pytest.fixture(scope="module")
def checkpoint(template_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = _checkpoint("qwen3_moe", tmp_path_factory.mktemp("ckpt"), vocab_size=PADDED_VOCAB)
    for f in template_tokenizer_dir.iterdir():
        shutil.copy2(f, path / f.name)
    return path


def test_the_format_follows_the_policy_directory(checkpoint: Path, tmp_path: Path) -> None:
    chat = chat_format_for(checkpoint)
    assert isinstance(chat, TemplateChatFormat)
    assert 300 <= chat.tok.vocab_size < PADDED_VOCAB - 100
    assert isinstance(chat_format_for(""), ChatFormat)
    # a stage's output keeps the checkpoint's tokenizer, so it speaks the same format
    policy = build_model(_config(checkpoint, tmp_path).model, chat.tok)
    saved = save_policy(policy, tmp_path / "saved", stage="test")
    again = load_policy(saved)
    assert isinstance(chat_format_for(again.config.path), TemplateChatFormat)
    assert chat_format_for(again.config.path).VERSION == chat.VERSION
    # the byte tokenizer still needs exactly its 266 ids
    with pytest.raises(ConfigValueError, match="266"):
        build_model(policy.config, ChatFormat().tok)
    # a tokenizer without a chat template is named in one line
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy2(checkpoint / "tokenizer.json", bare / "tokenizer.json")
    with pytest.raises(ConfigValueError, match=r"^model\.path: .*no chat template[^\n]*$"):
        chat_format_for(bare)


def test_rl_on_a_padded_checkpoint_with_its_own_template(checkpoint: Path, tmp_path: Path) -> None:
    # the template lists the tools' schemas: ~2,900 ids of this small tokenizer
    config = _config(checkpoint, tmp_path, max_turns=2, max_new_tokens=8, max_len=4096)
    chat = chat_format_for(checkpoint)
    assert isinstance(chat, TemplateChatFormat)
    vocab = chat.tok.vocab_size
    samples: list[Sample] = []

    def reward(sample: Sample) -> float:
        samples.append(sample)
        return _parity(sample)

    hooks, published, applied = _weight_hooks(reward)
    policy = build_model(config.model, chat.tok)
    summary = reinforce(policy, config, run_dir=tmp_path / "rl_dir", task_offset=0, hooks=hooks)
    assert summary.steps_done == 2 and sorted(published) == [1, 2]
    assert applied and all(applied.values()), applied

    assert len(samples) >= 4  # groups of equal rewards are played again
    for s in samples:
        # the prompt is the template's rendering of the task's messages and the tools
        prompt, _ = chat.render(s.messages[:2], add_generation_prompt=True, tools=tool_schemas())
        assert "# Tools" in chat.tok.decode(prompt)
        assert s.tokens[: len(prompt)] == prompt
        sampled = [t for t, m in zip(s.tokens, s.loss_mask, strict=True) if m]
        assert sampled and max(sampled) < vocab, "a padded id was sampled"
        # turns that are not a <tool_call> block are refused by the template's parser
        errors = [m["content"] for m in s.messages if m["role"] == "tool"]
        assert len(errors) == s.format_errors and all("<tool_call>" in e for e in errors)

    # the trainer re-scored the rollouts: the same log-probs on every sampled token
    records = read_metrics(tmp_path / "rl_dir" / "metrics.jsonl")
    checked = [r for r in records if r.get("mismatch_tokens")]
    assert checked and all(r["mismatch_max_abs"] == 0.0 for r in checked)
    assert sum(r["mismatch_tokens"] for r in checked) <= sum(s.generated_tokens for s in samples)
    assert all(r["routing_agreement_replay"] == 1.0 for r in records)

    # independently: the checkpoint's own weights (version 0) score step 0's ids with the
    # engine's log-probs, and without the mask the padded ids would hold much of the mass
    first = [s for s in samples if s.max_version == 0]
    assert first
    model = load_hf(checkpoint, dtype=torch.float32, config=config.model)
    batch = collate([first])
    with torch.no_grad(), batch_invariant(True):
        lp, _, _ = score(model, batch, "R3", config.engine.temperature, vocab)
        full = model(batch.input_ids[:, :-1], (batch.attention_mask.sum(1) - 1)).logits
    for i, s in enumerate(first):
        at = [j for j, m in enumerate(s.loss_mask) if m]
        assert lp[i, at].tolist() == [s.logprobs[j] for j in at]
    padded_mass = full.float().softmax(-1)[..., vocab:].sum(-1)
    assert padded_mass.mean() > 0.2


def test_midtrain_and_eval_speak_the_checkpoints_template(checkpoint: Path, tmp_path: Path) -> None:
    from tandem.orchestrator import evaluate_policy, midtrain_policy

    base = _config(checkpoint, tmp_path, max_turns=4, max_new_tokens=4, max_len=4096)
    config = msgspec.convert(
        {
            **msgspec.to_builtins(base),
            "run": {"output_dir": str(tmp_path), "name": "byo", "seed": 1},
            "midtrain": {
                "steps": 2,
                "batch_size": 2,
                "window": 32,
                "transcripts": 2,
                "transcript_fraction": 0.5,
                "code_bytes": 8_000,
            },
            "eval": {"tasks": 1, "samples": 1, "ks": [1]},
        },
        RunConfig,
    )
    chat = chat_format_for(checkpoint)
    _, info = midtrain_policy(config)
    assert info["steps"] == 2 and info["transcripts"] >= 1
    # the oracle's transcripts were rendered with the template: its turn tokens are in them
    cached = msgspec.json.decode(
        (config.run_dir / "cache" / "oracle_transcripts.json").read_bytes()
    )
    ids = cached["items"][0][0]
    assert chat.end_id in ids and chat.call_open in ids and max(ids) < chat.tok.vocab_size
    saved = config.run_dir / "midtrained"
    assert (saved / "tokenizer.json").is_file()
    policy = load_policy(saved)
    assert chat_format_for(policy.config.path).VERSION == chat.VERSION
    result = evaluate_policy(policy, config)
    assert result.tasks == 1 and 0.0 <= result.pass_at[1] <= 1.0


def test_a_rollout_actor_rebuilds_the_checkpoints_format(checkpoint: Path, tmp_path: Path) -> None:
    """A Ray rollout actor's body, started from its spec after the spec's round trip through
    the wire (all an actor in another process gets), speaks the checkpoint's template: its
    prompts list the tools, it never samples a padded id, and its engine holds the published
    weights bit for bit."""
    import asyncio

    from tandem.delta_sync import LocalStore
    from tandem.orchestrator.backends.ray.worker import RolloutWorker, WorkerSpec, state_digest
    from tandem.orchestrator.training.weights import WeightPublisher, state_for_sync
    from tandem.orchestrator.wire import PlayedGroup, decode

    config = _config(checkpoint, tmp_path, max_turns=2, max_new_tokens=8, max_len=4096)
    chat = chat_format_for(checkpoint)
    policy = load_policy(checkpoint)
    assert policy.config.path == str(checkpoint)
    store = tmp_path / "weights"
    store.mkdir()
    publisher = WeightPublisher(LocalStore(str(store)), policy, anchor_every=10)
    publisher.publish(0)
    publisher.close()
    spec = WorkerSpec(
        model=policy.config,
        engine=config.engine,
        env=config.env,
        episode=config.episode,
        tasks=config.tasks,
        task_seed=config.tasks.train_seed,
        task_offset=0,
        seed=0,
        group_size=2,
        store_url=str(store),
    )
    spec = msgspec.msgpack.decode(msgspec.msgpack.encode(spec), type=WorkerSpec)
    worker = RolloutWorker(spec, "actor-0", torch_threads=1, poll_s=0.05)

    async def play() -> tuple[int, PlayedGroup, tuple[int, str]]:
        try:
            version = await worker.start(follow=False)
            played = decode(await worker.play(0, 0), PlayedGroup)
            return version, played, worker.digest()
        finally:
            await worker.stop()

    version, played, digest = asyncio.run(play())
    assert version == 0 and digest == (0, state_digest(state_for_sync(policy)))
    assert len(played.samples) == 2
    for s in played.samples:
        prompt, _ = chat.render(s.messages[:2], add_generation_prompt=True, tools=tool_schemas())
        assert s.tokens[: len(prompt)] == prompt
        sampled = [t for t, m in zip(s.tokens, s.loss_mask, strict=True) if m]
        assert sampled and max(sampled) < chat.tok.vocab_size
