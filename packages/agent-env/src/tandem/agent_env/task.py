"""The task record: a repository snapshot, an instruction and hidden tests."""

from __future__ import annotations

import msgspec


class HiddenCase(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One hidden test as data: ``expr`` (a call over literals, e.g. ``clamp(5, 0, 3)``) is
    evaluated after ``imports`` in the grading sandbox, and its result's canonical text (exact
    types and values, see ``sandbox/inside/canon.py``) must equal ``expected``. The expected
    text stays on the host: the test process only computes results, the host judges them.
    """

    id: str
    imports: str
    expr: str
    expected: str


class HiddenTests(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Tests the agent never sees; they decide the reward.

    ``files`` (path -> content) are laid over the final workspace before grading, and
    ``reset_paths`` are restored to their original content, so edits the agent made to test
    files cannot change the verdict. ``framework`` is ``unittest`` (ids like
    ``tests.test_x.TestX.test_y``, run by the standard library) or ``pytest`` (node ids; pytest
    must be importable by the sandbox's interpreter, see ``SandboxConfig.ro_binds``).

    ``cases`` are hidden tests as data (`HiddenCase`), judged on the host: the strongest
    form, used by the generated task sources. Their ids are listed in ``fail_to_pass`` and
    ``pass_to_pass`` like any other test's.
    """

    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...] = ()
    files: dict[str, str] = {}
    reset_paths: tuple[str, ...] = ()
    framework: str = "unittest"
    cases: tuple[HiddenCase, ...] = ()


class TaskLimits(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Per-task overrides of the episode budgets (None keeps the config's value)."""

    max_turns: int | None = None
    episode_wall_s: float | None = None
    grade_timeout_s: float | None = None


class ReferenceEdit(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One exact-string replacement of the reference fix (what an oracle sends to `edit`)."""

    path: str
    old: str
    new: str


class Task(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One coding task.

    The snapshot is either inline (``files``: path -> text, used by generated tasks so a
    task is self-contained in one JSON line) or ``repo_path``: a directory or a
    ``.tar``/``.tar.gz``/``.tgz``/``.zip`` archive on the host. The reference fix is kept as
    exact edits or a unified diff so an oracle agent can demonstrate it through the tools.
    """

    id: str
    instruction: str
    hidden_tests: HiddenTests
    files: dict[str, str] = {}
    repo_path: str = ""
    visible_test_command: str = "python3 -m unittest discover -s tests -t . -q"
    reference_edits: tuple[ReferenceEdit, ...] = ()
    reference_patch: str = ""
    limits: TaskLimits = TaskLimits()
    metadata: dict[str, str] = {}
