"""The judge: decides a grading's verdict from what the test process reported, as data.

The test process imports the agent's code, so its output is untrusted bytes. This side never
imports that code: it reads at most a bounded number of bytes and lines, checks each line
against `Record` (exact types, bounded lengths; anything else is dropped), and decides:

- a hidden-test case (`HiddenCase`) passes only if exactly one record carries its id and a
  ``value`` equal to the expected canonical text kept on the host (the sandbox never sees it);
- a classic test (a test file's id) passes if exactly one record carrying this grading's
  seal (a secret the host made for it, never in the test process's argv or environment)
  reports it ``passed``, and the run reached its sealed ``done`` line: the runner writes that
  only after checking that the test framework was not tampered with (``integrity.py``). A
  ``tampered`` line, or no sealed ``done``, fails every classic test;
- a grading that reported ``started`` (written by the runner before any of the agent's code is
  imported) is the agent's from then on: crashes, exits, ``fatal`` lines, floods and silence
  score 0. Only a grading that never started is an infrastructure fault.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

import msgspec

from tandem.agent_env.task import HiddenCase, Task

MAX_LINE_BYTES = 1 << 17
"""Longest record line read; a longer one ends the reading (the rest is not read)."""
MAX_OUTPUT_BYTES = 4 << 20
"""Most bytes read from one grading's test process."""

_Id = Annotated[str, msgspec.Meta(max_length=4096)]
_Text = Annotated[str, msgspec.Meta(max_length=MAX_LINE_BYTES)]


class Record(msgspec.Struct, frozen=True):
    """One line from the test process. Unknown keys are ignored; wrong types drop the line."""

    id: _Id | None = None
    status: Literal["passed", "failed", "error", "skipped", "missing"] | None = None
    value: _Text | None = None
    raised: _Text | None = None
    detail: _Text = ""
    started: bool = False
    done: bool = False
    fatal: _Text | None = None
    seal: _Id | None = None
    tampered: _Text | None = None


_decode = msgspec.json.Decoder(Record).decode


class Reported:
    """What was read from one grading, within the bounds."""

    def __init__(self, max_records: int) -> None:
        self.records: list[Record] = []
        self.max_records = max_records
        self.dropped = 0
        self.bytes = 0
        self.overflow = False
        self.timed_out = False

    def add(self, line: bytes) -> bool:
        """Take one line; False once the bounds are reached (stop reading then)."""
        self.bytes += len(line)
        if self.bytes > MAX_OUTPUT_BYTES or len(self.records) >= self.max_records:
            self.overflow = True
            return False
        try:
            self.records.append(_decode(line))
        except msgspec.DecodeError:
            self.dropped += 1
        return True


async def read_records(reader: asyncio.StreamReader, out: Reported) -> None:
    """Read lines until EOF or a bound (the reader's limit must be `MAX_LINE_BYTES`)."""
    while True:
        try:
            line = await reader.readline()
        except (ValueError, asyncio.LimitOverrunError):
            out.overflow = True
            return
        if not line or not out.add(line):
            return


def record_budget(task: Task) -> int:
    """How many lines a grading may report: a few per test, plus the framing."""
    hidden = task.hidden_tests
    return 4 * (len(hidden.fail_to_pass) + len(hidden.pass_to_pass) + len(hidden.cases)) + 16


class Verdict(msgspec.Struct, frozen=True):
    """Per-test statuses, or why there is none (``infra``: the grading never started)."""

    tests: dict[str, str]
    infra: str = ""
    detail: str = ""


def judge(task: Task, ids: list[str], out: Reported, stderr: str = "", seal: str = "") -> Verdict:
    """The verdict for ``ids`` from what ``out`` holds (``seal``: the grading's secret, for
    classic tests)."""
    records = out.records
    if not records or not records[0].started:
        fatal = next((r.fatal for r in records if r.fatal), None)
        why = fatal or f"grading did not start: {stderr[-800:]}"
        return Verdict({}, infra=why)
    cases: dict[str, HiddenCase] = {c.id: c for c in task.hidden_tests.cases}
    seen: dict[str, list[Record]] = {}
    done = sealed_done = False
    tampered = ""
    notes: list[str] = []
    for r in records[1:]:
        if r.id is not None and (r.id in cases or r.seal == seal):
            seen.setdefault(r.id, []).append(r)
        done = done or r.done
        sealed_done = sealed_done or (r.done and r.seal == seal)
        tampered = tampered or (r.tampered or "")
        if r.fatal and len(notes) < 2:
            notes.append(f"the test process reported: {r.fatal[:300]}")
    if tampered:
        notes.append(f"the test framework was tampered with: {tampered[:300]}")
    elif not sealed_done and not out.timed_out and any(t not in cases for t in ids):
        notes.append("the test process did not finish its checks")
    tests: dict[str, str] = {}
    details: dict[str, str] = {}
    for t in ids:
        got = seen.get(t, [])
        if len(got) > 1:
            tests[t], details[t] = "error", "reported more than once"
        elif not got:
            tests[t] = "timeout" if out.timed_out else "error"
        elif t in cases:
            r = got[0]
            ok = r.value is not None and r.raised is None and r.value == cases[t].expected
            tests[t] = "passed" if ok else "failed"
            if not ok:
                details[t] = f"raised {r.raised}" if r.raised else f"returned {str(r.value)[:300]}"
        elif tampered or not sealed_done:  # its report cannot be told from a forged one
            tests[t] = "timeout" if out.timed_out else "failed"
        else:
            tests[t] = got[0].status or "error"
            details[t] = got[0].detail
    if out.overflow:
        notes.append(
            f"grading output over {MAX_OUTPUT_BYTES} bytes, {out.max_records} lines or a "
            f"{MAX_LINE_BYTES}-byte line: the rest was not read"
        )
    if out.timed_out:
        notes.append("timed out")
    elif not done and not out.overflow and not tampered:
        notes.append("test process died")
    failing = [f"{t}: {tests[t]}: {details.get(t, '')[-300:]}" for t in ids if tests[t] != "passed"]
    detail = "\n".join(notes + failing[:5]).strip()
    return Verdict(tests, detail=detail)
