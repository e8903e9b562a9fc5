"""Episode records: OpenAI-style messages plus per-step metadata, serialisable as JSONL."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import msgspec


class Observation(msgspec.Struct, frozen=True):
    """What the agent sees after a call (the content of the ``tool`` message), or after a
    text-only answer (the ``user`` message that answers it)."""

    content: str
    is_error: bool = False


class StepResult(msgspec.Struct, frozen=True):
    """Result of ``Env.step`` (one turn): ``reward`` is set only when ``done`` (None on infra
    faults). ``observations`` holds one per tool call of the turn, in order (the text-answer
    observation for a turn without calls); ``observation`` is that of the last call that ran.
    """

    observation: Observation
    done: bool
    reward: float | None = None
    info: dict[str, Any] = {}
    observations: tuple[Observation, ...] = ()


class StepRecord(msgspec.Struct):
    """Per-step metadata: which tool, how it went, how long, and the policy's own metadata."""

    turn: int
    tool: str
    is_error: bool
    seconds: float
    info: dict[str, Any] = {}
    policy: dict[str, Any] = {}


class Trajectory(msgspec.Struct):
    """One episode. ``reward`` is None when ``infra_fault`` (the episode must be masked)."""

    task_id: str
    messages: list[dict[str, Any]]
    steps: list[StepRecord]
    termination: str
    reward: float | None
    resolved: bool = False
    infra_fault: bool = False
    test_results: dict[str, str] = {}
    turns: int = 0
    wall_s: float = 0.0
    grade_detail: str = ""
    metadata: dict[str, Any] = {}


def render_text(traj: Trajectory) -> str:
    """A plain-text transcript (for example of the oracle) for mid-training on tool use.

    Tool calls are shown as JSON in a fixed format; a chat template applied by the trainer is
    the other option, this is the dependency-free one.
    """
    out = []
    for m in traj.messages:
        role = m["role"]
        if role == "assistant":
            if m.get("content"):
                out.append(f"<assistant>\n{m['content']}")
            for c in m.get("tool_calls") or []:
                fn = c["function"]
                out.append(
                    f"<tool_call>\n{json.dumps({'name': fn['name'], 'arguments': fn['arguments']}, ensure_ascii=False)}"
                )
        elif role == "tool":
            out.append(f"<tool_result>\n{m['content']}")
        else:
            out.append(f"<{role}>\n{m['content']}")
    return "\n\n".join(out) + "\n"


_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder(Trajectory)


def to_json(traj: Trajectory) -> bytes:
    return _enc.encode(traj)


def write_jsonl(path: str | Path, trajectories: Iterable[Trajectory], append: bool = False) -> None:
    with open(path, "ab" if append else "wb") as f:
        for t in trajectories:
            f.write(_enc.encode(t) + b"\n")


def read_jsonl(path: str | Path) -> Iterator[Trajectory]:
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                yield _dec.decode(line)
