"""`OpenAIPolicy` against a fake OpenAI-compatible server on loopback (no other network)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tandem.agent_env import (
    TEXT_ANSWER_OBSERVATION,
    EnvConfig,
    OpenAIPolicy,
    PolicyError,
    Task,
    run_episodes,
    tool_schemas,
)


class FakeServer:
    """Answers POSTs with scripted (status, body, delay) replies and records every request."""

    def __init__(self) -> None:
        self.replies: list[tuple[int, bytes, float]] = []
        self.requests: list[dict[str, Any]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                server.requests.append(
                    {"path": self.path, "headers": dict(self.headers), "body": json.loads(body)}
                )
                status, payload, delay = server.replies.pop(0)
                time.sleep(delay)
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except OSError:  # the client gave up (the timeout test)
                    pass

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def reply(self, message: dict[str, Any], status: int = 200, delay: float = 0.0) -> None:
        body = {
            "id": "x",
            "object": "chat.completion",
            "choices": [{"index": 0, "message": message}],
        }
        self.replies.append((status, json.dumps(body).encode(), delay))

    def raw(self, status: int, payload: bytes, delay: float = 0.0) -> None:
        self.replies.append((status, payload, delay))

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeServer]:
    for var in ("no_proxy", "NO_PROXY"):  # a proxy set for the machine must not take loopback
        monkeypatch.setenv(var, "127.0.0.1")
    s = FakeServer()
    yield s
    s.close()


def _call(call_id: str, name: str, **args: Any) -> dict[str, Any]:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args)},
    }


def test_an_endpoint_plays_an_episode_with_calls_several_calls_and_text(
    server: FakeServer, config: EnvConfig, add_task: Task
) -> None:
    fix = {"path": "calc.py", "old_string": "a - b", "new_string": "a + b"}
    server.reply(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [_call("c1", "edit", **fix), _call("c2", "run_tests")],
        }
    )
    server.reply({"role": "assistant", "content": "Fixed, I think."})
    server.reply({"role": "assistant", "content": None, "tool_calls": [_call("c3", "submit")]})
    policy = OpenAIPolicy(
        server.base_url + "/", "tiny-model", api_key="sk-test", temperature=0.5, max_tokens=99
    )
    (traj,) = asyncio.run(run_episodes(policy, [add_task], concurrency=1, config=config))
    assert traj.reward == 1.0 and traj.termination == "submitted" and traj.turns == 3
    assert [r["path"] for r in server.requests] == ["/v1/chat/completions"] * 3

    first = server.requests[0]
    assert first["headers"]["Authorization"] == "Bearer sk-test"
    body = first["body"]
    assert body["model"] == "tiny-model" and body["tools"] == tool_schemas()
    assert body["temperature"] == 0.5 and body["max_tokens"] == 99
    assert [m["role"] for m in body["messages"]] == ["system", "user"]
    assert body["messages"][1]["content"] == add_task.instruction

    second = server.requests[1]["body"]["messages"]
    assert [m["role"] for m in second] == ["system", "user", "assistant", "tool", "tool"]
    assert second[2]["tool_calls"] == [_call("c1", "edit", **fix), _call("c2", "run_tests")]
    assert [m["tool_call_id"] for m in second[3:]] == ["c1", "c2"]
    assert "[exit code 0]" in second[4]["content"]

    third = server.requests[2]["body"]["messages"]
    assert third[5:] == [
        {"role": "assistant", "content": "Fixed, I think."},
        {"role": "user", "content": TEXT_ANSWER_OBSERVATION},
    ]
    assert traj.messages[: len(third)] == third


def test_without_a_key_no_authorization_header_and_options_left_out(server: FakeServer) -> None:
    server.reply({"role": "assistant", "content": "hi"})
    policy = OpenAIPolicy(server.base_url, "m", extra_body={"top_k": 5})
    reply = asyncio.run(policy([{"role": "user", "content": "hello"}]))
    assert reply == {"role": "assistant", "content": "hi"}
    sent = server.requests[0]
    assert "Authorization" not in sent["headers"]
    assert sent["body"]["top_k"] == 5 and "max_tokens" not in sent["body"]


def _fails(policy: OpenAIPolicy, *patterns: str) -> str:
    with pytest.raises(PolicyError) as e:
        asyncio.run(policy([{"role": "user", "content": "hello"}]))
    for p in patterns:
        assert p in str(e.value), str(e.value)
    return str(e.value)


def test_http_errors_name_the_url_and_status(server: FakeServer) -> None:
    url = server.base_url + "/chat/completions"
    server.raw(500, b'{"error": {"message": "model overloaded"}}')
    _fails(OpenAIPolicy(server.base_url, "m"), url, "HTTP 500", "model overloaded")
    server.raw(404, b"no such route")
    _fails(OpenAIPolicy(server.base_url, "m"), url, "HTTP 404", "no such route")


def test_malformed_responses_are_clear_errors(server: FakeServer) -> None:
    url = server.base_url + "/chat/completions"
    for payload, says in [
        (b"<html>gateway</html>", "not JSON"),
        (b'{"choices": []}', "choices[0].message"),
        (b'{"object": "error", "message": "bad model"}', "bad model"),
        (b'{"choices": [{"message": "text"}]}', "choices[0].message"),
    ]:
        server.raw(200, payload)
        _fails(OpenAIPolicy(server.base_url, "m"), url, "HTTP 200", says)


def test_timeouts_and_unreachable_servers(server: FakeServer) -> None:
    server.reply({"role": "assistant", "content": "late"}, delay=2.0)
    _fails(OpenAIPolicy(server.base_url, "m", timeout_s=0.3), "timed out", "0.3 s", "127.0.0.1")
    closed = FakeServer()
    closed.close()  # nothing listens on its port any more
    _fails(OpenAIPolicy(closed.base_url, "m"), closed.base_url + "/chat/completions")


def test_an_endpoint_failure_faults_the_episode_with_the_reason(
    server: FakeServer, config: EnvConfig, add_task: Task
) -> None:
    server.raw(503, b"overloaded")
    (traj,) = asyncio.run(
        run_episodes(OpenAIPolicy(server.base_url, "m"), [add_task], concurrency=1, config=config)
    )
    assert traj.termination == "policy_error" and traj.infra_fault and traj.reward is None
    assert "PolicyError" in traj.grade_detail and "HTTP 503" in traj.grade_detail


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="base_url"):
        OpenAIPolicy("localhost:8000/v1", "m")
    with pytest.raises(ValueError, match="timeout_s"):
        OpenAIPolicy("http://127.0.0.1:1/v1", "m", timeout_s=0)
