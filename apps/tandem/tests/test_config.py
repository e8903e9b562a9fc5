"""Config loading: TOML into msgspec Structs, unknown keys rejected by name, dotted overrides."""

from __future__ import annotations

import tomllib
from pathlib import Path

import msgspec
import pytest

from tandem.app.config import apply_overrides, dump_config, load_config, parse_override
from tandem.app.errors import ConfigError
from tandem.app.pipeline_config import PipelineConfig

DEMO = Path(__file__).resolve().parents[3] / "configs" / "demo.toml"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_loads_toml_and_keeps_defaults(tmp_path: Path) -> None:
    cfg = load_config(PipelineConfig, _write(tmp_path, '[run]\nname = "exp"\n'))
    assert cfg.run.name == "exp"
    assert cfg.run.seed == 0
    assert cfg.logging.format == "auto"


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[run]\nnmae = 'x'\n", "run.nmae"),
        ("[trainer]\nlrate = 1e-6\n", "trainer.lrate"),
        ("[trainr]\nlr = 1e-6\n", "trainr"),
        ("[env.sandbox.limits]\npid = 3\n", "env.sandbox.limits.pid"),
        ("extra = 1\n", "extra"),
    ],
)
def test_unknown_key_is_named(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError, match=rf"unknown key `{key}`"):
        load_config(PipelineConfig, _write(tmp_path, text))


def test_wrong_type_names_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"run\.seed: Expected `int`, got `str`"):
        load_config(PipelineConfig, _write(tmp_path, "[run]\nseed = 'three'\n"))


def test_validation_in_struct_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"logging: level must be one of"):
        load_config(PipelineConfig, None, ["logging.level=loud"])


def test_overrides_win_over_file_and_are_typed(tmp_path: Path) -> None:
    path = _write(tmp_path, "[run]\nseed = 1\nname = 'a'\n")
    cfg = load_config(PipelineConfig, path, ["run.seed=7", "run.name=b c", "run.output_dir='/x/y'"])
    assert (cfg.run.seed, cfg.run.name, cfg.run.output_dir) == (7, "b c", "/x/y")


@pytest.mark.parametrize(
    ("item", "parts", "value"),
    [
        ("a.b=1e-6", ["a", "b"], 1e-6),
        ("a=true", ["a"], True),
        ("a.b.c=[1, 2]", ["a", "b", "c"], [1, 2]),
        ("a=hello", ["a"], "hello"),
        ("a=", ["a"], ""),
    ],
)
def test_parse_override(item: str, parts: list[str], value: object) -> None:
    assert parse_override(item) == (parts, value)


@pytest.mark.parametrize("item", ["novalue", "=1", "a..b=1"])
def test_bad_override_is_rejected(item: str) -> None:
    with pytest.raises(ConfigError, match="override"):
        parse_override(item)


def test_override_through_a_value_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"a\.b is a value, not a table"):
        apply_overrides({"a": {"b": 1}}, ["a.b.c=2"])


def test_overrides_do_not_mutate_input() -> None:
    data = {"a": {"b": 1}}
    assert apply_overrides(data, ["a.b=2"]) == {"a": {"b": 2}}
    assert data == {"a": {"b": 1}}


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(PipelineConfig, tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(PipelineConfig, _write(tmp_path, "[run\n"))


def test_a_file_lists_what_it_changes_in_its_base(tmp_path: Path) -> None:
    """Tables merge key by key (nested ones too), lists and values replace the base's, the
    base's path is relative to the file, and overrides still win over both."""
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "a.toml").write_text(
        "[run]\nname = 'a'\nseed = 3\n[tasks]\nfunctions = ['gcd', 'clamp']\n"
        "[trainer.loss]\nclip_eps_high = 0.3\nmax_tokens = 100\n"
    )
    top = _write(
        tmp_path,
        "base = 'base/a.toml'\n[run]\nname = 'b'\n[tasks]\nfunctions = ['median']\n"
        "[trainer.loss]\nmax_tokens = 200\n",
    )
    cfg = load_config(PipelineConfig, top, ["run.seed=4"])
    assert (cfg.run.name, cfg.run.seed) == ("b", 4)
    assert cfg.tasks.functions == ["median"]
    assert (cfg.trainer.loss.clip_eps_high, cfg.trainer.loss.max_tokens) == (0.3, 200)
    assert load_config(PipelineConfig, top).run.seed == 3


def test_a_base_that_is_missing_circular_or_not_a_name_is_named(tmp_path: Path) -> None:
    (tmp_path / "a.toml").write_text("base = 'b.toml'\n")
    (tmp_path / "b.toml").write_text("base = 'a.toml'\n")
    with pytest.raises(ConfigError, match=r"b\.toml: base = 'a\.toml' leads back to itself"):
        load_config(PipelineConfig, tmp_path / "a.toml")
    with pytest.raises(ConfigError, match=r"nope\.toml does not exist"):
        load_config(PipelineConfig, _write(tmp_path, "base = 'nope.toml'\n"))
    with pytest.raises(ConfigError, match=r"base must be a file name, not 3"):
        load_config(PipelineConfig, _write(tmp_path, "base = 3\n"))


def test_the_quick_config_is_the_demo_on_one_family() -> None:
    """configs/quick.toml changes only what it says: its run's name, the task family, the
    mid-training's length and mix, and the groups of a step."""
    configs = Path(__file__).resolve().parents[3] / "configs"
    quick = msgspec.to_builtins(load_config(PipelineConfig, configs / "quick.toml"))
    demo = msgspec.to_builtins(load_config(PipelineConfig, configs / "demo.toml"))
    changed = {
        f"{section}.{key}"
        for section in demo
        for key in demo[section]
        if quick[section][key] != demo[section][key]
    }
    assert changed == {
        "run.name",
        "tasks.functions",
        "tasks.kinds",
        "midtrain.steps",
        "midtrain.transcripts",
        "midtrain.transcript_fraction",
        "rl.groups_per_step",
    }
    assert quick["tasks"]["functions"] == ["gcd"] and quick["midtrain"]["steps"] == 80


def test_dump_shows_every_setting_and_loads_back_to_the_same_config(tmp_path: Path) -> None:
    """Library configs nested as they are (the sandbox's limits too); settings TOML cannot
    write (None) appear as comments, and the dump loads back to an equal config."""
    cfg = load_config(PipelineConfig, None, ["trainer.loss.is_lower=0.5", "env.max_turns=7"])
    text = dump_config(cfg)
    assert "[env.sandbox.limits]" in text and "pids = 256" in text
    assert "# dual_clip = (unset)" in text and "is_lower = 0.5" in text
    assert load_config(PipelineConfig, _write(tmp_path, text)) == cfg


def test_dump_round_trips() -> None:
    cfg = load_config(PipelineConfig, None, ["run.seed=5", "logging.level=debug"])
    text = dump_config(cfg)
    assert tomllib.loads(text)["run"]["seed"] == 5
    again = load_config(PipelineConfig, None, [])
    assert again != cfg
    path_cfg = load_config(
        PipelineConfig, None, [f"run.seed={cfg.run.seed}", "logging.level=debug"]
    )
    assert path_cfg == cfg


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.loss.kl_coef=-0.1", r"trainer\.loss: GRPOConfig\.kl_coef=-0\.1: must be a fin"),
        ("trainer.loss.kl_estimator='k4'", r"trainer\.loss\.kl_estimator"),
        ("trainer.loss.micro_batch_size=0", r"trainer\.loss: GRPOConfig\.micro_batch_size=0"),
        ("trainer.loss.entropy_coef=-0.1", r"GRPOConfig\.entropy_coef=-0\.1: must be a finite"),
        ("rl.torch_threads=-1", r"rl: torch_threads: must be >= 0"),
        ("rl.trainer_threads_alone=2", r"rl: trainer_threads_alone: must be 0, or >= torch_t"),
        ("env.max_turns=0", r"env: max_turns must be >= 1"),
        ("env.sandbox.limits.pids=0", r"env\.sandbox\.limits: pids must be > 0"),
        ("model.num_experts_per_tok=9", r"model: num_experts_per_tok must be in"),
        ("trainer.processes=5", r"trainer\.processes: 5 ranks for rl\.groups_per_step = 4"),
    ],
)
def test_bad_library_settings_fail_when_the_config_loads(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(PipelineConfig, None, [override])


def test_a_checkpoint_path_replaces_the_shapes_of_the_layers_below(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The demo's tiny model does not stand in the way of ``model.path``: a layer that sets
    the path (``--set``, or a file over its base) drops the shapes of the layers below and
    takes the checkpoint's; shapes set beside the path are checked against it."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tandem.app.cli import main

    ckpt = tmp_path / "ckpt"
    shapes = dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=24)
    hf = Qwen3MoeConfig(
        vocab_size=266, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, num_experts=4, num_experts_per_tok=2, **shapes,
    )  # fmt: skip
    Qwen3MoeForCausalLM(hf).save_pretrained(ckpt)
    demo = load_config(PipelineConfig, DEMO)
    assert demo.model.hidden_size == 96 and demo.model.num_hidden_layers == 2

    by_set = load_config(PipelineConfig, DEMO, [f"model.path={ckpt}"])
    top = _write(tmp_path, f"base = '{DEMO}'\n[model]\npath = '{ckpt}'\n")
    by_file = load_config(PipelineConfig, top)
    for cfg in (by_set, by_file):
        assert (cfg.model.hidden_size, cfg.model.num_hidden_layers) == (32, 1)
        assert cfg.model.moe_intermediate_size == 24 and cfg.model.path == str(ckpt)
        assert cfg.tasks == demo.tasks and cfg.rl == demo.rl  # the rest is the demo's

    with pytest.raises(ConfigError, match=r"model\.hidden_size: 96, but the checkpoint"):
        load_config(PipelineConfig, DEMO, [f"model.path={ckpt}", "model.hidden_size=96"])
    assert main(["demo", "--set", f"model.path={ckpt}", "--dump-config"]) == 0
    assert "hidden_size = 32" in capsys.readouterr().out
