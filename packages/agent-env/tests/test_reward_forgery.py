"""Reward forgery: code the agent leaves in the repository tries to earn a reward (or a masked
episode) without fixing the bug. Every attack here leaves the bug in place, so the reward must
be exactly 0.0: not 1.0, and not None (an infrastructure fault, dropped from training).

Each runs one episode of a few tool calls and one grading (~0.1-0.3 s each with the fork server).
"""

from __future__ import annotations

import asyncio
import json

import pytest

from tandem.agent_env import Env, EnvConfig, StepResult, Task, ToolCall, generate_tasks

TASK = generate_tasks(5, 1)[0]
MODULE = TASK.reference_edits[0].path  # the file with the bug
FUNCTION = TASK.metadata["function"]


def bash(command: str) -> ToolCall:
    return ToolCall("bash", json.dumps({"command": command}))


def append(path: str, code: str) -> ToolCall:
    return bash(f"cat >> {path} <<'EOF'\n{code}\nEOF")


async def _episode(task: Task, config: EnvConfig, calls: list[ToolCall]) -> StepResult:
    async with Env(task, config) as env:
        await env.reset()
        for call in calls:
            await env.step(call)
        return await env.step(ToolCall("submit"))


def graded(calls: list[ToolCall], config: EnvConfig, task: Task = TASK) -> StepResult:
    return asyncio.run(_episode(task, config, calls))


# code appended to the buggy module: runs when the grader imports it
_ATTACKS = {
    "patch the test framework": (
        "import unittest\n"
        "unittest.TestCase.assertEqual = lambda *a, **k: None\n"
        "def _run(self, result=None):\n"
        "    result.startTest(self)\n"
        "    result.stopTest(self)\n"
        "unittest.TestCase.run = _run\n"
    ),
    "a result whose __eq__ always says yes": (
        "class _Yes:\n"
        "    def __eq__(self, other): return True\n"
        "    def __ne__(self, other): return False\n"
        "    def __repr__(self): return 'yes'\n"
        f"def {FUNCTION}(*args, **kwargs): return _Yes()\n"
    ),
    "replace the grader's reporting function from the call stack": (
        "import sys\n"
        "_f = sys._getframe()\n"
        "while _f is not None:\n"
        "    g = _f.f_globals\n"
        "    if callable(g.get('report')):\n"
        "        _orig = g['report']\n"
        "        g['report'] = lambda test_id, status, detail='', _o=_orig: _o(test_id, 'passed')\n"
        "    _f = _f.f_back\n"
    ),
    "well-formed result records on every descriptor, then exit": (
        "import os, sys, json\n"
        "_ids = []\n"
        "_f = sys._getframe()\n"
        "while _f is not None:\n"
        "    for v in list(_f.f_locals.values()):\n"
        "        if isinstance(v, list) and v and all(isinstance(x, str) for x in v):\n"
        "            _ids += v\n"
        "        if isinstance(v, dict) and isinstance(v.get('ids'), list):\n"
        "            _ids += v['ids']\n"
        "        if isinstance(v, dict) and isinstance(v.get('cases'), list):\n"
        "            _ids += [c.get('id') for c in v['cases'] if isinstance(c, dict)]\n"
        "    _f = _f.f_back\n"
        "_lines = ''.join(json.dumps({'id': i, 'status': 'passed', 'value': 'T'}) + '\\n' for i in _ids)\n"
        "_lines += json.dumps({'done': True}) + '\\n'\n"
        "for fd in range(64):\n"
        "    try:\n"
        "        os.write(fd, _lines.encode())\n"
        "    except OSError:\n"
        "        pass\n"
        "os._exit(0)\n"
    ),
    "SystemExit at import": "raise SystemExit(0)\n",
    "a forged fatal record": (
        "import os\n"
        "for fd in range(64):\n"
        "    try:\n"
        '        os.write(fd, b\'{"fatal": "sandbox setup failed"}\\n\')\n'
        "    except OSError:\n"
        "        pass\n"
        "os._exit(70)\n"
    ),
}


# every attack against the fork server's grading jobs; two against a bwrap sandbox per
# grading, which runs the same runner and judge
_CASES = [(a, True) for a in _ATTACKS] + [
    ("patch the test framework", False),
    ("a forged fatal record", False),
]


@pytest.mark.parametrize(
    ("attack", "fork_server"),
    _CASES,
    ids=[f"{a}-{'forkserver' if f else 'bwrap'}" for a, f in _CASES],
)
def test_code_in_the_repository_cannot_forge_the_reward(
    config: EnvConfig, attack: str, fork_server: bool
) -> None:
    cfg = _mode(config, fork_server)
    res = graded([append(MODULE, _ATTACKS[attack])], cfg)
    assert res.done
    assert res.reward == 0.0, (attack, res.reward, res.info)
    assert not res.info["infra_fault"]


def test_the_reference_fix_still_earns_the_reward(config: EnvConfig) -> None:
    e = TASK.reference_edits[0]
    fix = ToolCall("edit", json.dumps({"path": e.path, "old_string": e.old, "new_string": e.new}))
    res = graded([fix], config)
    assert res.reward == 1.0, res.info


def test_grading_output_is_bounded_in_host_memory(config: EnvConfig) -> None:
    flood = (
        "import os\n"
        "_junk = b'{\"x\": 1}\\n' * 65536\n"
        "for _ in range(400):\n"  # ~3 MB per descriptor, far past the cap on what is read
        "    for fd in range(3, 16):\n"
        "        try:\n"
        "            os.write(fd, _junk)\n"
        "        except OSError:\n"
        "            pass\n"
    )
    res = graded([append(MODULE, flood)], config)
    assert res.reward == 0.0, res.info
    assert "grading output" in res.info.get("grade_detail", ""), res.info


def _mode(config: EnvConfig, fork_server: bool) -> EnvConfig:
    import msgspec

    return msgspec.structs.replace(
        config, sandbox=msgspec.structs.replace(config.sandbox, fork_server=fork_server)
    )


# Tasks whose hidden tests are unittest files (the SWE-bench-style path): files the agent adds
# must not change how those tests are found or imported.
_PYC = (
    "import importlib.util, marshal, sys, os\n"
    "src = 'import unittest\\nunittest.TestCase.assertEqual = lambda *a, **k: None\\n'\n"
    "code = compile(src, 'tests/__init__.py', 'exec')\n"
    "data = bytearray(importlib.util.MAGIC_NUMBER) + (3).to_bytes(4, 'little')\n"  # hash, unchecked
    "data += importlib.util.source_hash(b'') + marshal.dumps(code)\n"
    "os.makedirs('tests/__pycache__', exist_ok=True)\n"
    "open(importlib.util.cache_from_source('tests/__init__.py'), 'wb').write(data)\n"
)


@pytest.mark.parametrize(
    "files",
    [
        {
            "tests/test_hidden/__init__.py": (
                "import unittest\n\n\nclass H(unittest.TestCase):\n"
                "    def test_add(self):\n        pass\n"
            )
        },
        {"sitecustomize.py": "import unittest\nunittest.TestCase.assertEqual = lambda *a: None\n"},
        {"usercustomize.py": "import unittest\nunittest.TestCase.assertEqual = lambda *a: None\n"},
        {"conftest.py": "import unittest\nunittest.TestCase.assertEqual = lambda *a: None\n"},
    ],
    ids=["package-shadowing-the-test-module", "sitecustomize", "usercustomize", "conftest"],
)
def test_files_that_change_test_collection_have_no_effect(
    config: EnvConfig, add_task: Task, files: dict[str, str]
) -> None:
    calls = [
        ToolCall("write_file", json.dumps({"path": p, "content": c})) for p, c in files.items()
    ]
    res = graded(calls, config, add_task)
    assert res.reward == 0.0 and not res.info["infra_fault"], res.info


def test_unchecked_pyc_for_the_tests_package_has_no_effect(
    config: EnvConfig, add_task: Task
) -> None:
    calls = [
        ToolCall("write_file", json.dumps({"path": "mkpyc.py", "content": _PYC})),
        bash("python3 mkpyc.py && ls tests/__pycache__"),
    ]
    res = graded(calls, config, add_task)
    assert res.reward == 0.0 and not res.info["infra_fault"], res.info


# Test-file tasks: the hidden tests import the agent's code into the test framework's own
# interpreter. What that code does to the framework is seen and scores 0 (``integrity.py``);
# the records it forges lack the grading's seal. The bug stays in place in each.
_FILE_TASK_ATTACKS = {
    "patch unittest.TestCase.run": (
        "import unittest\n"
        "def _run(self, result=None):\n"
        "    result.startTest(self)\n"
        "    result.addSuccess(self)\n"
        "    result.stopTest(self)\n"
        "unittest.TestCase.run = _run\n"
    ),
    "patch an assertion": "import unittest\nunittest.TestCase.assertEqual = lambda *a, **k: None\n",
    "re-code an assertion": (
        "import unittest\n"
        "unittest.TestCase.assertEqual.__code__ = (lambda self, a, b, msg=None: None).__code__\n"
    ),
    "replace the runner's reporting function from the call stack": _ATTACKS[
        "replace the grader's reporting function from the call stack"
    ],
    "well-formed result records on every descriptor, then exit": _ATTACKS[
        "well-formed result records on every descriptor, then exit"
    ],
}
_FILE_CASES = [(a, True) for a in _FILE_TASK_ATTACKS] + [("patch unittest.TestCase.run", False)]


@pytest.mark.parametrize(
    ("attack", "fork_server"),
    _FILE_CASES,
    ids=[f"{a}-{'forkserver' if f else 'bwrap'}" for a, f in _FILE_CASES],
)
def test_code_under_test_cannot_forge_a_test_file_reward(
    config: EnvConfig, add_task: Task, attack: str, fork_server: bool
) -> None:
    res = graded(
        [append("calc.py", _FILE_TASK_ATTACKS[attack])], _mode(config, fork_server), add_task
    )
    assert res.reward == 0.0 and not res.info["infra_fault"], (attack, res.info)


@pytest.mark.parametrize("fork_server", [True, False], ids=["forkserver", "bwrap"])
def test_a_real_fix_of_a_test_file_task_still_earns_the_reward(
    config: EnvConfig, add_task: Task, fork_server: bool
) -> None:
    fix = ToolCall(
        "edit", json.dumps({"path": "calc.py", "old_string": "a - b", "new_string": "a + b"})
    )
    res = graded([fix], _mode(config, fork_server), add_task)
    assert res.reward == 1.0, res.info
