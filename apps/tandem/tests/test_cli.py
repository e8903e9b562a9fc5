"""The `tandem` console script: help, config validation, --dump-config and logging output."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tomllib

import structlog

from tandem.app.cli import main
from tandem.app.logging import configure_logging


def test_console_script_help() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tandem.app.cli", "--help"], capture_output=True, text=True
    )
    assert proc.returncode == 0
    assert "usage: tandem" in proc.stdout
    assert "config" in proc.stdout


def test_dump_config_applies_overrides(capsys) -> None:
    assert main(["config", "--set", "run.seed=11", "--dump-config"]) == 0
    out = capsys.readouterr().out
    assert tomllib.loads(out)["run"]["seed"] == 11


def test_config_prints_every_section(capsys) -> None:
    """`tandem config` without a file shows the whole run config, the libraries' too."""
    assert main(["config", "--set", "logging.level=error"]) == 0
    printed = tomllib.loads(capsys.readouterr().out)
    sections = {"run", "logging", "model", "tasks", "env", "episode", "midtrain", "engine"}
    assert sections | {"trainer", "rl", "eval", "demo"} <= set(printed)
    assert printed["env"]["sandbox"]["limits"]["pids"] > 0
    assert printed["trainer"]["loss"]["loss_agg"] == "constant"


def test_bad_key_exits_2_with_its_name(capsys) -> None:
    assert main(["config", "--set", "run.sed=1"]) == 2
    err = capsys.readouterr().err
    assert "unknown key `run.sed`" in err
    assert "Traceback" not in err


def test_json_logs_when_not_a_tty() -> None:
    stream = io.StringIO()
    configure_logging("info", "auto", stream=stream)
    structlog.get_logger("t").info("step done", step=3)
    structlog.get_logger("t").debug("hidden")
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert lines == [lines[0]] and lines[0]["event"] == "step done" and lines[0]["step"] == 3
    assert lines[0]["level"] == "info"


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_console_logs_on_a_tty() -> None:
    stream = _Tty()
    configure_logging("debug", "auto", stream=stream)
    structlog.get_logger("t").debug("visible", k=1)
    text = stream.getvalue()
    assert "visible" in text
    try:
        json.loads(text)
    except ValueError:
        pass
    else:  # pragma: no cover - a JSON line here means the TTY was ignored
        raise AssertionError("expected console rendering on a TTY, got JSON")


def test_train_address_selects_the_ray_backend(capsys) -> None:
    assert main(["train", "--address", "10.0.0.1:6379", "--dump-config"]) == 0
    out = capsys.readouterr().out
    assert 'backend = "ray"' in out and 'address = "10.0.0.1:6379"' in out


def test_workers_refuses_a_bad_count(capsys) -> None:
    assert main(["workers", "add", "0", "--address", "auto", "--run", "x"]) == 2
    assert "count must be >= 1" in capsys.readouterr().err
