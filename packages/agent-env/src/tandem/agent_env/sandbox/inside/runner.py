"""Hidden-test runner: runs inside the grading sandbox, reports one JSON line per test.

This process imports the agent's code, so nothing it reports is trusted: the host (the judge,
``grading.py``) checks every line against a schema and decides the verdict. Hidden tests given
as data (``cases``) report only the canonical text of each result (``canon.py``); the expected
values never enter the sandbox. Classic test files (``unittest`` ids, ``pytest`` node ids)
report a status per id, which code in the same process could forge (see the package's
README, "Threat model").

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
    from .jsonlite import dumps, loads
    from .lockdown import own_keyring
except ImportError:  # run as a script (python -I leaves the script's directory off sys.path)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from canon import canon
    from jsonlite import dumps, loads
    from lockdown import own_keyring

    del sys.path[0]
    for _name in ("jsonlite", "canon", "lockdown"):  # workspace modules may have these names
        sys.modules.pop(_name, None)

# Set by main(); importing this module has no side effects.
SPEC = {}
RESULTS = sys.stderr


def report(test_id, status, detail=""):
    RESULTS.write(dumps({"id": test_id, "status": status, "detail": detail[-2000:]}) + "\n")


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
        RESULTS.write(dumps(record) + "\n")


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


def run_unittest(ids):
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

    loader = unittest.TestLoader()
    for test_id in ids:
        try:
            suite = loader.loadTestsFromName(test_id)
        except Exception as e:
            report(test_id, "error", f"{type(e).__name__}: {e}")
            continue
        result = Result()
        suite.run(result)
        if result.bad:
            report(test_id, result.bad[0][0], result.bad[0][1])
        elif result.ran == 0:
            report(test_id, "missing", "no test found")
        else:
            report(test_id, "passed")


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
    ``started``, from this runner itself (nothing of the agent's has run then)."""
    global SPEC, RESULTS
    SPEC, RESULTS = spec, results
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
    site = [i for i, p in enumerate(sys.path) if p.endswith(("site-packages", "dist-packages"))]
    sys.path.insert(site[0] if site else len(sys.path), SPEC["workspace"])
    RESULTS.write(dumps({"started": True}) + "\n")
    RESULTS.flush()
    if SPEC.get("cases"):
        run_cases(SPEC["cases"])
    if ids and framework == "pytest":
        run_pytest(ids)
    elif ids:
        run_unittest(ids)
    RESULTS.write(dumps({"done": True}) + "\n")


def main():
    spec = loads(sys.argv[1])
    if spec["workspace"] == "/workspace":  # a bwrap sandbox (not a trusted local run)
        own_keyring()
    results = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    run(spec, results)


if __name__ == "__main__":
    main()
