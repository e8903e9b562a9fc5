"""What the command line shows: bars that advance on every path, log lines above the live
bars (not inside them), and help with defaults for every option."""

from __future__ import annotations

import argparse
import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time

import numpy as np
import pytest
import rich.progress

from tandem.delta_sync import LocalStore, Publisher, safetensors_io
from tandem.delta_sync.cli import build_parser, main


@pytest.fixture
def bars(monkeypatch) -> list[dict[str, tuple[float, float | None]]]:
    """The bars of every progress display as it stopped: {phase: (completed, total)}."""
    seen: list[dict[str, tuple[float, float | None]]] = []
    stop = rich.progress.Progress.stop

    def recording_stop(self) -> None:
        seen.append({t.description: (t.completed, t.total) for t in self.tasks})
        stop(self)

    monkeypatch.setattr(rich.progress.Progress, "stop", recording_stop)
    return seen


def _versions(tmp_path, n: int = 2) -> list[str]:
    rng = np.random.default_rng(0)
    w = rng.normal(0, 1, (256, 256)).astype(np.float32)
    paths = []
    for v in range(n):
        w.view(np.uint32)[v::97] += 1
        path = tmp_path / f"v{v}.safetensors"
        safetensors_io.save(path, {"w": w, "b": np.full(256, v, np.float32)})
        paths.append(str(path))
    return paths


def _full(bar: dict[str, tuple[float, float | None]], *phases: str) -> None:
    for phase in phases:
        assert phase in bar, (phase, bar)
        done, total = bar[phase]
        assert done > 0 and done == total, (phase, bar)


def test_pull_out_progress_reaches_its_total(tmp_path, bars) -> None:
    store = tmp_path / "store"
    Publisher(LocalStore(store)).publish(0, safetensors_io.load(_versions(tmp_path, 1)[0]))
    assert main(["pull", str(store), "--out", str(tmp_path / "out.safetensors")]) == 0
    _full(bars[-1], "download")  # stayed at 0: materialize dropped the callback


def test_progress_bars_advance_on_every_path(tmp_path, bars) -> None:
    store = str(tmp_path / "store")
    v0, v1 = _versions(tmp_path)
    assert main(["publish", store, v0, "--version", "0"]) == 0
    _full(bars[-1], "encode", "upload")
    assert main(["publish", store, v1, "--version", "1"]) == 0  # a fresh publisher: rebuilds
    _full(bars[-1], "rebuild", "encode", "upload")
    assert main(["pull", store]) == 0
    _full(bars[-1], "download")
    assert main(["pull", store, "--mirror", str(tmp_path / "relay")]) == 0
    _full(bars[-1], "mirror")


_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07]*\x07")


def _run_in_terminal(argv: list[str], timeout: float = 120) -> str:
    """Run the CLI with stdout and stderr on a pseudo-terminal; everything it wrote."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "COLUMNS", "LINES")}
    env["TERM"] = "xterm-256color"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.delta_sync.cli", *argv],
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=slave,
        env=env,
    )
    os.close(slave)
    out = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(master, 1 << 16)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
        assert proc.wait(timeout=max(deadline - time.monotonic(), 1)) == 0, out.decode()
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    return out.decode(errors="replace")


def test_log_lines_go_above_the_live_bars_not_into_them(tmp_path) -> None:
    store = str(tmp_path / "store")
    v0, v1 = _versions(tmp_path)
    assert main(["publish", store, v0, "--version", "0"]) == 0
    # a fresh publisher on a store with versions logs while its bars are live
    text = _run_in_terminal(["publish", store, v1, "--version", "1"])
    assert "━" in text, text  # the bars were drawn live
    lines = [seg for seg in re.split(r"[\r\n]", _ANSI.sub("", text)) if seg.strip()]
    events = [line for line in lines if "delta_sync.published" in line]
    assert events, text
    for line in events:
        before = line[: line.index("delta_sync.published")]
        assert "━" not in before and "upload" not in before and "encode" not in before, line


def test_every_option_has_help_and_shows_its_default() -> None:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in commands.choices.items():
        formatter = sub._get_formatter()
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"{name} {action.dest}: no help"
            if action.option_strings and not action.required:
                shown = formatter._get_help_string(action)
                assert "(default: " in shown, f"{name} {action.option_strings}: {shown!r}"
    text = " ".join(commands.choices["publish"].format_help().split())
    assert "(default: 25)" in text and "(default: one per CPU core)" in text
