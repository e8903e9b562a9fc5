"""``model.path``: a Hugging Face model directory as the policy every stage starts from.

The checkpoint is built here with transformers (Qwen3-MoE with a dense layer, sharded); the
stages read it through the run config, and what they save is read back by transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import torch

from tandem.agent_env import EnvConfig
from tandem.moe_determinism import MoEConfig
from tandem.orchestrator import RunConfig, evaluate_policy, load_policy, midtrain_policy
from tandem.orchestrator.config import (
    ConfigValueError,
    EngineConfig,
    EvalConfig,
    MidtrainConfig,
    RunSettings,
    TaskConfig,
)
from tandem.orchestrator.inference.tokenizer import ByteTokenizer
from tandem.orchestrator.policy import build_model, save_policy

VOCAB = 266  # the byte tokenizer's ids, which the stages tokenize with


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=24,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        mlp_only_layers=[1],
        norm_topk_prob=True,
    )
    path = tmp_path_factory.mktemp("hf_model")
    Qwen3MoeForCausalLM(cfg).save_pretrained(path, max_shard_size="60KB")
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 4096}))
    return path


def _run(hf_dir: Path, tmp_path: Path, **model: object) -> RunConfig:
    return msgspec.convert(
        {
            "run": {"output_dir": str(tmp_path), "name": "byo"},
            "model": {"path": str(hf_dir), **model},
        },
        RunConfig,
    )


def test_config_takes_the_shapes_from_the_checkpoint(hf_dir: Path, tmp_path: Path) -> None:
    config = _run(hf_dir, tmp_path, kv_split_size=16)
    m = config.model
    assert (m.vocab_size, m.num_hidden_layers, m.num_experts, m.moe_layers) == (
        VOCAB,
        3,
        4,
        (0, 2),
    )
    assert (m.intermediate_size, m.kv_split_size, m.path) == (48, 16, str(hf_dir))
    # a resolved config (as `tandem config` prints it) reads back to itself
    assert msgspec.convert(msgspec.to_builtins(config), RunConfig) == config
    # RL and evaluation start from the checkpoint until a mid-trained policy exists
    assert config.policy_dir == hf_dir
    (config.run_dir / "midtrained").mkdir(parents=True)
    assert config.policy_dir == config.run_dir / "midtrained"


@pytest.mark.parametrize(
    ("layout", "named"),
    [
        ("nothing", "missing the directory itself"),
        ("config_only", "missing weights (model.safetensors, or shards with"),
        ("weights_only", "missing config.json"),
    ],
)
def test_a_path_that_is_not_a_model_directory_is_named(
    hf_dir: Path, tmp_path: Path, layout: str, named: str
) -> None:
    target = tmp_path / "model"
    if layout != "nothing":
        target.mkdir()
        keep = "config.json" if layout == "config_only" else "model-00001*.safetensors"
        for f in hf_dir.glob(keep):
            (target / f.name).write_bytes(f.read_bytes())
    with pytest.raises(msgspec.ValidationError) as err:
        _run(target, tmp_path)
    msg = str(err.value)
    assert msg.startswith("model.path: ") and named in msg and "\n" not in msg


def test_a_shape_set_twice_must_agree(hf_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(
        msgspec.ValidationError, match=r"model\.hidden_size: 64, but the checkpoint"
    ):
        _run(hf_dir, tmp_path, hidden_size=64)
    assert _run(hf_dir, tmp_path, hidden_size=32).model.hidden_size == 32


def test_policy_from_path_matches_transformers_and_saves_back(hf_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    config = _run(hf_dir, tmp_path)
    policy = build_model(config.model, ByteTokenizer())
    ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = torch.randint(0, 266, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = torch.log_softmax(policy(ids).logits, -1)
        theirs = torch.log_softmax(ref(ids).logits, -1)
    assert float((ours - theirs).abs().max()) <= 1e-5

    out = save_policy(policy, tmp_path / "exported", stage="test")
    assert {"config.json", "tandem.json", "tokenizer_config.json", "generation_config.json"} <= {
        f.name for f in out.iterdir()
    }
    back = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(back(ids).logits, ref(ids).logits)
    # the checkpoint itself (no tandem.json yet) loads as a policy too
    assert torch.equal(load_policy(hf_dir).lm_head.weight, policy.lm_head.weight)


def test_a_vocabulary_other_than_the_tokenizers_is_refused() -> None:
    cfg = MoEConfig(vocab_size=300, path="/somewhere")
    with pytest.raises(ConfigValueError, match=r"vocabulary has 300 ids and the tokenizer 266"):
        build_model(cfg, ByteTokenizer())


def test_midtrain_and_eval_run_from_the_checkpoint(hf_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    base = _run(hf_dir, tmp_path, kv_split_size=16)
    config = msgspec.structs.replace(
        base,
        run=RunSettings(name="byo", output_dir=str(tmp_path), seed=1),
        tasks=TaskConfig(functions=["gcd"], functions_per_repo=1),
        env=EnvConfig(max_turns=1, allow_unsandboxed=True, episode_wall_s=120.0),
        midtrain=MidtrainConfig(
            steps=2, batch_size=2, window=32, transcript_fraction=0.0, code_bytes=8_000
        ),
        engine=EngineConfig(max_slots=4, max_len=512, max_new_tokens=4),
        eval=EvalConfig(tasks=2, samples=1, ks=[1]),
    )
    start = build_model(config.model, ByteTokenizer())
    model, info = midtrain_policy(config)
    assert info["steps"] == 2
    assert not torch.equal(model.lm_head.weight, start.lm_head.weight)  # it trained
    saved = config.run_dir / "midtrained"
    assert (saved / "tokenizer_config.json").exists()
    back = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
    assert torch.equal(back.lm_head.weight, model.lm_head.weight)
    assert config.policy_dir == saved
    result = evaluate_policy(load_policy(config.policy_dir), config)
    assert result.tasks == 2 and 0.0 <= result.pass_at[1] <= 1.0
