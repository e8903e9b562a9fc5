"""Joining a Ray cluster: the token found as Ray's tools find it, one line naming what to
set when the cluster cannot be joined, and a joined cluster's shortfall never an error."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tandem.orchestrator.backends import ray as ray_backend
from tandem.orchestrator.backends.ray import auth
from tandem.orchestrator.config import RayConfig, RLConfig, RunConfig
from tandem.orchestrator.protocols import BackendStart


def test_the_token_is_found_where_ray_looks(tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert auth.token_source({}, home) is None
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("abc")
    assert auth.token_source({}, home) == str(home / ".ray" / "auth_token")
    other = tmp_path / "token"
    assert auth.token_source({"RAY_AUTH_TOKEN_PATH": str(other)}, home) is None  # named, absent
    other.write_text("def\n")
    assert auth.token_source({"RAY_AUTH_TOKEN_PATH": str(other)}, home) == str(other)
    assert auth.token_source({"RAY_AUTH_TOKEN": "xyz", "RAY_AUTH_TOKEN_PATH": "/nope"}) == (
        "RAY_AUTH_TOKEN"
    )


def test_an_explicit_auth_mode_is_kept_and_no_token_means_disabled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    for var in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE"):
        monkeypatch.delenv(var, raising=False)
    assert auth.use_token_if_available() == "disabled"
    monkeypatch.setenv("RAY_AUTH_MODE", "Disabled")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "xyz")
    assert auth.use_token_if_available() == "disabled"


def test_a_cluster_that_cannot_be_joined_is_one_line_naming_what_to_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    message = auth.unreachable(closed, "disabled")
    assert "nothing listens there" in message and "\n" not in message

    with socket.create_server(("127.0.0.1", 0)) as server:
        address = f"127.0.0.1:{server.getsockname()[1]}"
        monkeypatch.setenv("RAY_AUTH_TOKEN", "xyz")
        message = auth.unreachable(address, "token")
        assert "refused the token from RAY_AUTH_TOKEN" in message
        assert "set RAY_AUTH_TOKEN to what `uv run ray get-auth-token` prints" in message
        monkeypatch.delenv("RAY_AUTH_TOKEN")
        monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
        message = auth.unreachable(address, "disabled")
        assert "requires a token" in message and "RAY_AUTH_MODE" not in message
        monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
        message = auth.unreachable(address, "disabled")
        assert "set RAY_AUTH_MODE=token (it is 'disabled') and set RAY_AUTH_TOKEN" in message
        assert "\n" not in message


@pytest.mark.parametrize(("address", "started_here"), [("", True), ("10.0.0.1:6379", False)])
def test_only_a_cluster_started_here_has_its_shortfall_checked_as_an_error(
    monkeypatch: pytest.MonkeyPatch, address: str, started_here: bool
) -> None:
    """``connect`` initializes Ray for a join too; the sizing check must still see a join."""
    seen: list[bool] = []

    class Checked(Exception):
        pass

    def check(rl, processes, *, started_here: bool) -> list[str]:
        seen.append(started_here)
        raise Checked

    monkeypatch.setattr(ray_backend, "connect", lambda config: True)
    monkeypatch.setattr(ray_backend, "check_cluster_fits", check)
    config = RunConfig(rl=RLConfig(backend="ray", ray=RayConfig(address=address)))
    with pytest.raises(Checked):
        ray_backend.build(
            BackendStart(version=0, stream=0),
            policy=None,  # type: ignore[arg-type]
            config=config,
            tasks=None,  # type: ignore[arg-type]
            run_dir=Path("."),
        )
    assert seen == [started_here]
