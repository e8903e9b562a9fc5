"""`set_nice`: every thread of the process gets the value (Linux keeps one per thread), threads
started later inherit it, and a lower value (a higher priority) is not applied, not an error.
Checked in a child process: the test process keeps its own priority."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tandem.orchestrator.config import ConfigValueError, RayConfig
from tandem.orchestrator.runtime.priority import set_nice

CHILD = """
import json, os, threading
from tandem.orchestrator.runtime.priority import set_nice

def nice_of_threads():
    return sorted({os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")})

release = threading.Event()
early = threading.Thread(target=release.wait)  # running before the call
early.start()
start = os.getpriority(os.PRIO_PROCESS, 0)
target = min(start + 3, 19)
got = set_nice(target)
after = nice_of_threads()
late = {}
def report():  # started after the call: inherits the value of the thread that starts it
    late["nice"] = os.getpriority(os.PRIO_PROCESS, 0)
t = threading.Thread(target=report)
t.start(); t.join()
kept = set_nice(max(target - 2, 0))  # lower again: not allowed, the value stays
release.set(); early.join()
print(json.dumps({"start": start, "target": target, "got": got, "after": after,
                  "late": late["nice"], "kept": kept, "final": nice_of_threads()}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_every_thread_gets_the_value_and_it_cannot_be_lowered_again() -> None:
    own = os.getpriority(os.PRIO_PROCESS, 0)
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"child failed ({out.returncode}):\n{out.stderr[-4000:]}"
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["target"] > r["start"] or r["start"] == 19
    assert r["got"] == r["target"]
    assert r["after"] == [r["target"]]  # the main thread and the one already running
    assert r["late"] == r["target"]
    assert r["kept"] == r["target"] and r["final"] == [r["target"]]
    assert os.getpriority(os.PRIO_PROCESS, 0) == own  # the test process is untouched


@pytest.mark.parametrize("value", [-1, 20])
def test_values_outside_nice_range_are_refused(value: int) -> None:
    with pytest.raises(ValueError, match=r"0\.\.19"):
        set_nice(value)


@pytest.mark.parametrize("value", [-2, 20])
def test_the_config_takes_a_nice_value_or_minus_one(value: int) -> None:
    with pytest.raises(ConfigValueError, match="trainer_nice"):
        RayConfig(trainer_nice=value)
    assert RayConfig().trainer_nice == -1  # the default: Ray's own value


IDLE_CHILD = """
import json, os, subprocess, sys, threading
from tandem.orchestrator.runtime import priority

if sys.argv[1] == "refused":  # a sandbox that filters sched_setscheduler
    def refuse(*args):
        raise PermissionError(1, "Operation not permitted")
    os.sched_setscheduler = refuse
release = threading.Event()
early = threading.Thread(target=release.wait)  # running before the call
early.start()
got = priority.run_when_idle()
threads = sorted({os.sched_getscheduler(int(t)) for t in os.listdir("/proc/self/task")})
child = subprocess.run([sys.executable, "-c", "import os; print(os.sched_getscheduler(0))"],
                       capture_output=True, text=True, check=True).stdout
release.set(); early.join()
print(json.dumps({"got": got, "threads": threads, "child": int(child),
                  "nice": os.getpriority(os.PRIO_PROCESS, 0)}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SCHED_IDLE is Linux's")
@pytest.mark.parametrize("case", ["allowed", "refused"])
def test_run_when_idle_puts_every_thread_and_child_in_sched_idle(case: str) -> None:
    own = os.sched_getscheduler(0)
    out = subprocess.run(
        [sys.executable, "-c", IDLE_CHILD, case], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, f"child failed ({out.returncode}):\n{out.stderr[-4000:]}"
    r = json.loads(out.stdout.strip().splitlines()[-1])
    if case == "allowed":
        assert r["got"] == "SCHED_IDLE"
        assert r["threads"] == [os.SCHED_IDLE] and r["child"] == os.SCHED_IDLE
    else:  # the fallback: nice 19, the policy unchanged
        assert r["got"] == "nice 19" and r["nice"] == 19
        assert r["threads"] == [own] and r["child"] == own
    assert os.sched_getscheduler(0) == own  # the test process is untouched
