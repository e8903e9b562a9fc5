"""Joining a Ray cluster with or without its token authentication, as Ray's own tools do.

A head started with ``ray start --head`` turns token authentication on when this machine has
a token (``~/.ray/auth_token``, which any earlier local ``ray.init()`` writes), while a
client given an explicit address keeps ``RAY_AUTH_MODE`` at ``disabled`` and is refused
(``InvalidAuthToken``) after half a minute of retries. Ray finds a token in
``RAY_AUTH_TOKEN``, in the file named by ``RAY_AUTH_TOKEN_PATH`` or in
``~/.ray/auth_token``; a client that sends one is accepted by a cluster with authentication
off as well, so a run joins with token mode whenever a token is there and
``RAY_AUTH_MODE`` is unset (Ray does the same for ``address="auto"``). An explicit
``RAY_AUTH_MODE`` is always kept.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

AUTH_MODE = "RAY_AUTH_MODE"
TOKEN = "RAY_AUTH_TOKEN"
TOKEN_PATH = "RAY_AUTH_TOKEN_PATH"
GET_TOKEN = "uv run ray get-auth-token"


def token_source(env: dict[str, str] | None = None, home: Path | None = None) -> str | None:
    """Where Ray would read this machine's cluster token from (None: nowhere)."""
    env = dict(os.environ) if env is None else env
    if env.get(TOKEN, "").strip():
        return TOKEN
    path = env.get(TOKEN_PATH)
    if path:
        return path if _readable(Path(path).expanduser()) else None
    default = (home or Path.home()) / ".ray" / "auth_token"
    return str(default) if _readable(default) else None


def _readable(path: Path) -> bool:
    try:
        return bool(path.read_text().strip())
    except OSError:
        return False


def use_token_if_available() -> str:
    """The auth mode this process joins with: ``RAY_AUTH_MODE`` when set, else ``token``
    when a token is available (then set in the environment for Ray), else ``disabled``."""
    mode = os.environ.get(AUTH_MODE, "").strip().lower()
    if mode:
        return mode
    if token_source() is None:
        return "disabled"
    os.environ[AUTH_MODE] = "token"
    try:  # Ray caches its config at import; refresh it as Ray itself does on this switch
        from ray._raylet import Config

        Config.initialize("")
    except (ImportError, AttributeError):
        pass
    return "token"


def unreachable(address: str, mode: str) -> str:
    """One line on why joining ``address`` failed and what to set."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if host and port.isdigit() and not _listening(host, int(port)):
        return (
            f"cannot join the Ray cluster at {address}: nothing listens there (start it with "
            "`uv run ray start --head --port PORT` and pass that node's HOST:PORT)"
        )
    where = token_source()
    if mode == "token":
        return (
            f"cannot join the Ray cluster at {address}: it refused the token from {where} "
            f"(set {TOKEN} to what `{GET_TOKEN}` prints on the head node)"
        )
    fix = f"set {TOKEN} to what `{GET_TOKEN}` prints on the head node"
    if os.environ.get(AUTH_MODE):
        fix = f"set {AUTH_MODE}=token (it is {os.environ[AUTH_MODE]!r}) and {fix}"
    return (
        f"cannot join the Ray cluster at {address}: it did not accept this client, most likely "
        f"because it requires a token (its `ray start` printed 'Token authentication is "
        f"enabled'): {fix}"
    )


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=3):
            return True
    except OSError:
        return False
