"""Hidden-test runner: runs inside the grading sandbox, reports one JSON line per test.

This process imports the agent's code, so nothing it reports is trusted: the host (the judge,
``grading.py``) checks every line against a schema and decides the verdict. Hidden tests given
as data (``cases``) report only the canonical text of each result (``canon.py``); the expected
values never enter the sandbox. Classic test files (``unittest`` ids, ``pytest`` node ids)
report a status per id, which code in the same process could forge; to make that hard, every
record carries the grading's seal (a secret of the host's, given on stdin or in the fork
server's job, never in argv), the framework is snapshotted before the agent's code is imported
and checked after each test's import and run (``integrity.py``; a change is reported as
``tampered`` and scores 0), and ``done`` is written only after the last check. What remains
open is in the package's README, "Threat model".

Before any of the agent's code is imported (and before the ``started`` line): files the host
listed as changing how tests are collected or imported (``conftest.py``, test configuration,
``__pycache__``, ``.pth``, packages shadowing test modules, ...) are removed from this
throwaway view of the workspace, and the hidden files are checked against their content
hashes. A problem there is reported as ``fatal`` before ``started``: the host's fault.

Results go to the original stdout; everything the tests print goes to stderr. The workspace is
appended to ``sys.path`` *after* the standard library (the interpreter runs with ``-I``), so a
module the agent wrote cannot shadow ``unittest`` or other stdlib modules.

Stdlib only (pytest is imported only for pytest-style tasks). It starts once per graded
episode, so it uses the supervisor's small JSON codec: ``json`` imports ``re``, ``enum`` and
more, which costs about as much as the interpreter's own start-up.
"""

import os
import sys

try:
    from .canon import canon
    from .integrity import Snapshot, shadowed
    from .jsonlite import dumps, loads
    from .lockdown import own_keyring
except ImportError:  # run as a script (python -I leaves the script's directory off sys.path)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from canon import canon
    from integrity import Snapshot, shadowed
    from jsonlite import dumps, loads
    from lockdown import own_keyring

    del sys.path[0]
    for _name in (
        "jsonlite",
        "canon",
        "lockdown",
        "integrity",
    ):  # workspace modules may have these names
        sys.modules.pop(_name, None)

# Set by run(); importing this module has no side effects.
SPEC = {}
RESULTS = sys.stderr
SEAL = ""  # the host's secret for this grading: records without it are not counted


def emit(record):
    if SEAL:
        record["seal"] = SEAL
    RESULTS.write(dumps(record) + "\n")


def report(test_id, status, detail=""):
    emit({"id": test_id, "status": status, "detail": detail[-2000:]})


def _describe(e):
    """An exception raised by the agent's code, as text (its ``str`` may misbehave too)."""
    try:
        return f"{type(e).__name__}: {e}"[-500:]
    except BaseException:
        return "an exception that could not be shown"


def run_cases(cases):
    """Evaluate each case and report its result's canonical text (or what it raised)."""
    import builtins

    for case in cases:
        record = {"id": case["id"]}
        try:
            scope = {"__builtins__": builtins}
            exec(case["imports"], scope)
            record["value"] = canon(eval(case["expr"], scope))
        except BaseException as e:  # SystemExit too: a crash of the code under test scores 0
            record["raised"] = _describe(e)
        emit(record)


def _remove(path):
    """Delete ``path`` (a file, link or directory tree) without following links."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if (st.st_mode & 0o170000) == 0o040000:
        for root, dirs, files in os.walk(path, topdown=False):
            for name in files:
                os.unlink(os.path.join(root, name))
            for name in dirs:
                full = os.path.join(root, name)
                if os.path.islink(full):
                    os.unlink(full)
                else:
                    os.rmdir(full)
        os.rmdir(path)
    else:
        os.unlink(path)


def prepare(spec):
    """Lay the workspace for grading (no agent code has run yet); returns a problem or ""."""
    import hashlib

    for rel in spec.get("remove", []):
        if rel.startswith("/") or ".." in rel.split("/"):
            return f"refusing to remove {rel!r}"
        _remove(rel)
    for rel, digest in spec.get("hashes", {}).items():
        try:
            with open(rel, "rb") as f:
                got = hashlib.sha256(f.read()).hexdigest()
        except OSError as e:
            return f"hidden file {rel} is missing: {e}"
        if got != digest:
            return f"hidden file {rel} does not match its content hash"
    return ""


def result_class():
    """The result object's class for unittest tests (made once ``unittest`` is imported)."""
    import unittest

    class Result(unittest.TestResult):
        def __init__(self):
            super().__init__()
            self.bad = []
            self.ran = 0

        def startTest(self, test):
            self.ran += 1
            super().startTest(test)

        def addFailure(self, test, err):
            self.bad.append(("failed", self._exc_info_to_string(err, test)))

        def addError(self, test, err):
            self.bad.append(("error", self._exc_info_to_string(err, test)))

        def addSubTest(self, test, subtest, err):
            if err is not None:
                self.bad.append(("failed", self._exc_info_to_string(err, test)))

        def addUnexpectedSuccess(self, test):
            self.bad.append(("failed", "unexpected success"))

    return Result


def _cases_of(suite):
    """The test cases in ``suite``, with each one's test method as loaded."""
    import unittest

    out, stack = [], [suite]
    while stack:
        item = stack.pop()
        if isinstance(item, unittest.TestSuite):
            stack.extend(item._tests)
        elif item is not None:
            method = getattr(type(item), getattr(item, "_testMethodName", ""), None)
            out.append((item, method, getattr(method, "__code__", None)))
    return out


def _cases_changed(cases):
    for test, method, code in cases:
        now = getattr(type(test), getattr(test, "_testMethodName", ""), None)
        if now is not method or getattr(now, "__code__", None) is not code:
            return f"test method {type(test).__name__}.{test._testMethodName} was replaced"
        problem = shadowed(test, type(test))
        if problem:
            return problem
    return ""


def run_unittest(ids, result_cls, snapshot):
    """Run and report each test id; checks the framework after each import and each run.
    Returns what was found tampered with ("" if nothing), stopping there."""
    import unittest

    loader = unittest.TestLoader()
    for test_id in ids:
        try:
            suite = loader.loadTestsFromName(test_id)
        except Exception as e:
            report(test_id, "error", f"{type(e).__name__}: {e}")
            continue
        cases = _cases_of(suite)
        problem = snapshot.problem() or _cases_changed(cases)
        if problem:
            return problem
        result = result_cls()
        suite.run(result)
        problem = (
            snapshot.problem()
            or shadowed(result, result_cls)
            or shadowed(loader, unittest.TestLoader)
            or _cases_changed(cases)
        )
        if problem:
            return problem
        if result.bad:
            report(test_id, result.bad[0][0], result.bad[0][1])
        elif result.ran == 0:
            report(test_id, "missing", "no test found")
        else:
            report(test_id, "passed")
    return ""


def snapshot_framework(framework):
    """The framework as it is before any of the agent's code runs (``integrity.py``), and
    the result class for unittest."""
    result_cls = None
    modules = []
    if framework == "unittest":
        result_cls = result_class()
        modules = [
            m
            for name, m in list(sys.modules.items())
            if (name == "unittest" or name.startswith("unittest.")) and m is not None
        ]
    extra = [("runner", globals())]
    if result_cls is not None:
        extra.append(("runner.Result", result_cls))
    return Snapshot(modules, extra), result_cls


def run_pytest(ids):
    import pytest

    outcomes = {}
    details = {}

    class Collector:
        def pytest_runtest_logreport(self, report):
            prev = outcomes.get(report.nodeid)
            if report.failed:
                outcomes[report.nodeid] = "failed" if report.when == "call" else "error"
                details[report.nodeid] = str(report.longrepr)[-2000:]
            elif report.when == "call" and prev is None:
                outcomes[report.nodeid] = "passed" if report.passed else "skipped"
            elif report.skipped and prev is None:
                outcomes[report.nodeid] = "skipped"

    args = ["-p", "no:cacheprovider", "-q", "--rootdir", SPEC["workspace"], *ids]
    pytest.main(args, plugins=[Collector()])
    for test_id in ids:
        report(test_id, outcomes.get(test_id, "missing"), details.get(test_id, ""))


def run(spec, results):
    """Run the tests of ``spec`` from its workspace; one JSON line per test to ``results``
    (a text file), framed by ``started`` and ``done``. A ``fatal`` line comes only before
    ``started``, from this runner itself (nothing of the agent's has run then); a
    ``tampered`` line instead of ``done`` says what the agent's code changed in the test
    framework."""
    global SPEC, RESULTS, SEAL
    SPEC, RESULTS = spec, results
    SEAL = SPEC.pop("seal", "")
    os.chdir(SPEC["workspace"])
    framework = SPEC.get("framework", "unittest")
    ids = SPEC.get("ids", [])
    if framework not in ("unittest", "pytest"):
        RESULTS.write(dumps({"fatal": f"unknown test framework {framework!r}"}) + "\n")
        return
    problem = prepare(SPEC)
    # extra paths (e.g. a bound site-packages with pytest) go last; the workspace goes after
    # the standard library (so it cannot shadow it) but before site-packages
    sys.path.extend(SPEC.get("paths", []))
    if not problem and framework == "pytest" and ids:
        try:
            import pytest  # noqa: F401 - before the workspace is on sys.path
        except ImportError as e:
            problem = f"pytest is not importable in the sandbox: {e}"
    if problem:
        RESULTS.write(dumps({"fatal": problem}) + "\n")
        return
    snapshot = result_cls = None
    if ids:  # test files run with the agent's code: note the framework before it can run
        snapshot, result_cls = snapshot_framework(framework)
    site = [i for i, p in enumerate(sys.path) if p.endswith(("site-packages", "dist-packages"))]
    sys.path.insert(site[0] if site else len(sys.path), SPEC["workspace"])
    emit({"started": True})
    RESULTS.flush()
    if SPEC.get("cases"):
        run_cases(SPEC["cases"])
    if ids:
        tampered = snapshot.problem()
        if not tampered and framework == "pytest":
            run_pytest(ids)
            tampered = snapshot.problem()
        elif not tampered:
            tampered = run_unittest(ids, result_cls, snapshot)
        if tampered:
            emit({"tampered": tampered})
            return
    emit({"done": True})


_RLIMITS = {
    "as": "RLIMIT_AS",
    "nproc": "RLIMIT_NPROC",
    "fsize": "RLIMIT_FSIZE",
    "nofile": "RLIMIT_NOFILE",
}


def limit(rlimits):
    """Set the rlimits the host asked for (a grading sandbox started on its own; a fork
    server's job has them set by the server): without cgroups (rootless) they are what bounds
    the tests' memory and processes."""
    import resource

    for name, value in rlimits.items():
        resource.setrlimit(getattr(resource, _RLIMITS[name]), (int(value), int(value)))


def main():
    # the spec comes on stdin (the grading's seal must not be in /proc/self/cmdline)
    spec = loads(sys.argv[1] if len(sys.argv) > 1 else sys.stdin.read())
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    limit(spec.pop("rlimits", {}))
    if spec["workspace"] == "/workspace":  # a bwrap sandbox (not a trusted local run)
        own_keyring()
    results = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    run(spec, results)


if __name__ == "__main__":
    main()
