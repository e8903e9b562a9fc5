"""Hidden-test runner: runs inside the grading sandbox, reports one JSON line per test id.

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
    from .jsonlite import dumps, loads
except ImportError:  # run as a script (python -I leaves the script's directory off sys.path)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from jsonlite import dumps, loads

    del sys.path[0]
    sys.modules.pop("jsonlite", None)  # a workspace module may have that name

# Set by main(); importing this module has no side effects.
SPEC = {}
RESULTS = sys.stderr


def report(test_id, status, detail=""):
    RESULTS.write(dumps({"id": test_id, "status": status, "detail": detail[-2000:]}) + "\n")


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
    try:
        import pytest
    except ImportError as e:
        RESULTS.write(dumps({"fatal": f"pytest is not importable in the sandbox: {e}"}) + "\n")
        return

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
    """Run the tests of ``spec`` from its workspace; one JSON line per test id to
    ``results`` (a text file), framed by ``started`` and ``done``."""
    global SPEC, RESULTS
    SPEC, RESULTS = spec, results
    os.chdir(SPEC["workspace"])
    # the workspace goes after the standard library (so it cannot shadow it) but before
    # site-packages; extra paths (e.g. a bound site-packages with pytest) go last
    site = [i for i, p in enumerate(sys.path) if p.endswith(("site-packages", "dist-packages"))]
    sys.path.insert(site[0] if site else len(sys.path), SPEC["workspace"])
    sys.path.extend(SPEC.get("paths", []))
    RESULTS.write(dumps({"started": True}) + "\n")
    ids = SPEC["ids"]
    framework = SPEC.get("framework", "unittest")
    if framework == "pytest":
        run_pytest(ids)
    elif framework == "unittest":
        run_unittest(ids)
    else:
        RESULTS.write(dumps({"fatal": f"unknown test framework {framework!r}"}) + "\n")
    RESULTS.write(dumps({"done": True}) + "\n")


def main():
    results = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    run(loads(sys.argv[1]), results)


if __name__ == "__main__":
    main()
