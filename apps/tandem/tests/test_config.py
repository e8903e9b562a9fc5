"""Config loading: TOML into msgspec Structs, unknown keys rejected by name, dotted overrides."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from tandem.app.config import AppConfig, apply_overrides, dump_config, load_config, parse_override
from tandem.app.errors import ConfigError


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_loads_toml_and_keeps_defaults(tmp_path: Path) -> None:
    cfg = load_config(AppConfig, _write(tmp_path, '[run]\nname = "exp"\n'))
    assert cfg.run.name == "exp"
    assert cfg.run.seed == 0
    assert cfg.logging.format == "auto"


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[run]\nnmae = 'x'\n", "run.nmae"),
        ("[trainer]\nlr = 1e-6\n", "trainer"),
        ("extra = 1\n", "extra"),
    ],
)
def test_unknown_key_is_named(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError, match=rf"unknown key `{key}`"):
        load_config(AppConfig, _write(tmp_path, text))


def test_wrong_type_names_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"run\.seed: Expected `int`, got `str`"):
        load_config(AppConfig, _write(tmp_path, "[run]\nseed = 'three'\n"))


def test_validation_in_struct_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"logging: level must be one of"):
        load_config(AppConfig, None, ["logging.level=loud"])


def test_overrides_win_over_file_and_are_typed(tmp_path: Path) -> None:
    path = _write(tmp_path, "[run]\nseed = 1\nname = 'a'\n")
    cfg = load_config(AppConfig, path, ["run.seed=7", "run.name=b c", "run.output_dir='/x/y'"])
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
        load_config(AppConfig, tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(AppConfig, _write(tmp_path, "[run\n"))


def test_dump_round_trips() -> None:
    cfg = load_config(AppConfig, None, ["run.seed=5", "logging.level=debug"])
    text = dump_config(cfg)
    assert tomllib.loads(text)["run"]["seed"] == 5
    again = load_config(AppConfig, None, [])
    assert again != cfg
    path_cfg = load_config(AppConfig, None, [f"run.seed={cfg.run.seed}", "logging.level=debug"])
    assert path_cfg == cfg


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.loss.kl_coef=-0.1", r"trainer\.loss: kl_coef: must be a finite number >= 0"),
        ("trainer.loss.kl_estimator='k4'", r"trainer\.loss\.kl_estimator"),
        ("trainer.loss.micro_batch_size=0", r"trainer\.loss: micro_batch_size: must be >= 1"),
        ("rl.torch_threads=-1", r"rl: torch_threads: must be >= 0"),
    ],
)
def test_bad_loss_settings_fail_when_the_config_loads(override: str, message: str) -> None:
    from tandem.app.pipeline_config import PipelineConfig

    with pytest.raises(ConfigError, match=message):
        load_config(PipelineConfig, None, [override])
