"""Every way the command line is commonly misused ends in one line, `delta-sync: ...`, and
exit status 1: no traceback, nothing wrapped, the culprit named."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from tandem.delta_sync import HttpStore, Publisher, StoreError, safetensors_io
from tandem.delta_sync.cli import main


def _fails(capsys, argv: list[str], *needles: str) -> str:
    """Run the CLI; it must exit 1 with exactly one stderr line naming every needle."""
    rc = main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 1, err
    assert len(lines) == 1 and lines[0].startswith("delta-sync: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def _model(tmp_path) -> str:
    path = tmp_path / "m.safetensors"
    safetensors_io.save(path, {"w": np.ones((64, 64), np.float32), "b": np.zeros(64, np.float32)})
    return str(path)


def test_missing_input_file(tmp_path, capsys) -> None:
    missing = str(tmp_path / "missing.safetensors")
    _fails(capsys, ["publish", str(tmp_path / "s"), missing, "--version", "0"], missing, "no such")
    _fails(capsys, ["publish", str(tmp_path / "s"), missing[:-12] + "npz", "--version", "0"])


def test_safetensors_truncated_in_its_data(tmp_path, capsys) -> None:
    path = tmp_path / "cut.safetensors"
    with open(_model(tmp_path), "rb") as f:
        path.write_bytes(f.read()[:-100])  # 'w' is written last: it loses its end
    argv = ["publish", str(tmp_path / "s"), str(path), "--version", "0"]
    _fails(capsys, argv, str(path), "'w'", "truncated")


def test_serve_on_a_busy_port(tmp_path, capsys) -> None:
    (tmp_path / "s").mkdir()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        _fails(capsys, ["serve", str(tmp_path / "s"), "--port", str(port)], str(port), "port")


def test_a_store_directory_that_does_not_exist_is_named_as_such(tmp_path, capsys) -> None:
    missing = str(tmp_path / "no" / "such" / "store")
    for command in (["pull", missing], ["inspect", missing]):
        line = _fails(capsys, command, missing, "does not exist")
        assert not line.startswith("delta-sync: nothing has been published")


def test_an_unknown_url_scheme_is_not_taken_as_a_path(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    _fails(capsys, ["pull", "ftp://host/run"], "unknown store scheme 'ftp'")
    _fails(capsys, ["publish", "ftp://host/run", _model(tmp_path), "--version", "0"], "'ftp'")
    assert not (tmp_path / "ftp:").exists()  # no directory named after the URL


def test_complex64_is_refused_naming_the_tensor(tmp_path, capsys) -> None:
    npz = tmp_path / "c.npz"
    np.savez(npz, rotary=np.zeros(8, np.complex64), w=np.ones(4, np.float32))
    argv = ["publish", str(tmp_path / "s"), str(npz), "--version", "0"]
    line = _fails(capsys, argv, "'rotary'", "complex64")
    assert "upgrade" not in line
    st = pytest.importorskip("safetensors.numpy")
    path = tmp_path / "c.safetensors"
    st.save_file({"rotary": np.zeros(8, np.complex64)}, str(path))
    line = _fails(capsys, ["publish", str(tmp_path / "s"), str(path), "--version", "0"], "'rotary'")
    assert "complex64" in line and "upgrade" not in line


def test_publish_to_a_read_only_http_store_is_refused_before_any_work(
    tmp_path, capsys, monkeypatch
) -> None:
    def no_request(self, key):
        raise AssertionError(f"publish to a read-only store made a request for {key!r}")

    monkeypatch.setattr(HttpStore, "get", no_request)
    monkeypatch.setattr(HttpStore, "exists", no_request)
    url = "http://127.0.0.1:9/run"
    _fails(capsys, ["publish", url, _model(tmp_path), "--version", "1"], url, "read-only")
    with pytest.raises(StoreError, match="read-only"):
        Publisher(HttpStore(url))  # the Python API refuses it on construction
    dest = ["pull", str(tmp_path / "s"), "--mirror", url]
    _fails(capsys, dest, url, "read-only")


def test_long_messages_are_one_line_when_not_a_terminal(tmp_path, capsys) -> None:
    deep = tmp_path / ("a-rather-long-directory-name-" * 4) / ("and-another-one-" * 4)
    deep.mkdir(parents=True)
    model = _model(deep)
    store = str(deep / "store")
    _fails(capsys, ["pull", store], store)  # a message far longer than 80 columns
    assert main(["publish", store, model, "--version", "0"]) == 0
    out = str(deep / "out.safetensors")
    assert main(["pull", store, "--out", out]) == 0
    err = capsys.readouterr().err
    assert any(line.endswith(f"to {out}") for line in err.splitlines()), err
    assert main(["inspect", store]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("version 0") and "digest" in first  # not wrapped at 80
