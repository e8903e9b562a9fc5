"""The `delta-sync` command line and the safetensors reader/writer it uses."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import ml_dtypes
import numpy as np
import pytest

from tandem.delta_sync import HttpStore, LocalStore, StoreError, Subscriber, safetensors_io
from tandem.delta_sync.cli import main


def _state(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "w": rng.normal(0, 0.02, (300, 200)).astype(ml_dtypes.bfloat16),
        "b": rng.normal(0, 1, (200,)).astype(np.float32),
        "steps": np.arange(5, dtype=np.int64),
    }


def test_safetensors_round_trip_and_compatibility(tmp_path, same_bits) -> None:
    rng = np.random.default_rng(0)
    state = _state(rng)
    safetensors_io.save(tmp_path / "a.safetensors", state)
    same_bits(safetensors_io.load(tmp_path / "a.safetensors"), state)
    st = pytest.importorskip("safetensors.numpy")
    plain = {"b": state["b"], "steps": state["steps"]}
    st.save_file(plain, str(tmp_path / "ref.safetensors"))  # written by the reference library
    same_bits(safetensors_io.load(tmp_path / "ref.safetensors"), plain)
    torch_st = pytest.importorskip("safetensors.torch")
    loaded = torch_st.load_file(str(tmp_path / "a.safetensors"))  # ours, read by the reference
    same_bits(loaded, state)


def test_publish_inspect_pull(tmp_path, capsys, same_bits) -> None:
    rng = np.random.default_rng(1)
    store = str(tmp_path / "store")
    s0 = _state(rng)
    s1 = {k: v.copy() for k, v in s0.items()}
    s1["w"].view(np.uint16)[::50] += 1
    for v, s in enumerate((s0, s1)):
        safetensors_io.save(tmp_path / f"v{v}.safetensors", s)
        assert (
            main(["publish", store, str(tmp_path / f"v{v}.safetensors"), "--version", str(v)]) == 0
        )
    assert main(["inspect", store]) == 0
    out = capsys.readouterr().out
    assert "version 1" in out and "delta" in out
    assert main(["inspect", store, "--json", "--version", "0"]) == 0
    manifest = json.loads(capsys.readouterr().out)
    assert manifest["version"] == 0 and manifest["parts"][0]["payloads"][0]["kind"] == "full"
    assert main(["pull", store, "--out", str(tmp_path / "out.safetensors")]) == 0
    same_bits(safetensors_io.load(tmp_path / "out.safetensors"), s1)
    # mirror into a relay directory, then read the relay
    assert main(["pull", store, "--mirror", str(tmp_path / "relay")]) == 0
    same_bits(Subscriber(LocalStore(tmp_path / "relay")).materialize(), s1)
    # an older version is refused with a message, not a traceback
    assert main(["publish", store, str(tmp_path / "v0.safetensors"), "--version", "1"]) == 1
    assert "strictly increase" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["serve", "relay"])
def test_serve_and_relay_subcommands_serve_a_store_read_only(command, tmp_path, same_bits) -> None:
    rng = np.random.default_rng(2)
    root = tmp_path / "store"
    safetensors_io.save(tmp_path / "v0.safetensors", s0 := _state(rng))
    assert main(["publish", str(root), str(tmp_path / "v0.safetensors"), "--version", "0"]) == 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.delta_sync.cli", command, str(root), "--port", str(port)]
        + (["--cache", str(tmp_path / "cache")] if command == "relay" else []),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        store = HttpStore(f"http://127.0.0.1:{port}", retries=0, timeout=5)
        deadline = time.monotonic() + 120  # a loaded machine can take a while to start Python
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()
            try:
                store.exists("latest")
                break
            except StoreError:
                assert time.monotonic() < deadline, "server did not come up"
                time.sleep(0.2)
        same_bits(Subscriber(store).materialize(), s0)
        if command == "relay":  # what the relay fetched, it keeps
            cached = Subscriber(LocalStore(tmp_path / "cache"))
            same_bits(cached.materialize(cached.latest() or 0), s0)
        put = urllib.request.Request(f"{store.base_url}/latest", data=b"{}", method="PUT")
        with pytest.raises(urllib.error.HTTPError, match="405"):
            urllib.request.urlopen(put, timeout=5)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
