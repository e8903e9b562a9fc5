"""The cluster walk-through (docs/cluster.md, linked from the README), run as written here.

The commands are read from its "Run on a cluster" section (its first code block),
so the page cannot drift from what is tested. They run in a fresh environment: no
``RAY_*`` or ``AWS_*`` variable, a home directory of the test's own (so the token
``ray get-auth-token --generate`` makes is the only one, and the head node turns Ray's token
authentication on as it does by default), and a Ray temp directory of the test's own, so the
head node does not become the default cluster of other Ray users of this machine and its
processes are found and stopped without touching anyone else's. What the test changes in the
commands: the head's port (a free one, for 6379 may be taken), and ``--set`` overrides of
the output directory, of the periodic checkpoints (none, so that the one written on Ctrl-C
is what resumes) and of the log format appended to `tandem` commands. A README command
that needed any other variable or setting would fail here.

The walk-through mid-trains with the README's quick-check config (``configs/quick.toml``:
one task family, 80 steps, about 1 min on 2 cores), whose policy fixes some of its tasks, so
GRPO has signal from the first step; a weaker one would leave every step waiting on
``rl.no_signal``. The whole test takes about 3.5 min on 2 cores: it is ``slow``, and CI
(``.ci/run``) runs it after the default suite. ``TANDEM_MIDTRAINED`` set to the
``midtrained/`` directory of an earlier run skips the mid-training.

The run: mid-train, token, head node, `train` to two RL steps that train and publish, a
worker added (pending when the node has no room, with a warning) and removed while it
trains, SIGINT to the train command's process group as Ctrl-C sends it (one line, exit 130,
a checkpoint), and the train command again, which resumes from that checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tandem.app.config import load_config
from tandem.app.pipeline_config import PipelineConfig

ROOT = Path(__file__).resolve().parents[3]
UV = os.environ.get("UV", "uv")

SMALL = [
    # a checkpoint only when asked to stop
    "rl.checkpoint_every=1000",
    "logging.format=console",
]
MIDTRAINED = os.environ.get("TANDEM_MIDTRAINED", "")
"""A policy mid-trained by the README's command before (its ``midtrained/`` directory): the
test then copies it instead of mid-training again, to rerun the cluster part quickly."""


def walkthrough(readme: str) -> list[str]:
    """The commands of the first code block of the cluster section, continuations joined."""
    section = readme.split("## Run on a cluster", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "the cluster section has no bash block"
    text = block.group(1).replace("\\\n", " ")
    return [line.strip() for line in text.splitlines() if line.strip().startswith("uv run")]


def _command(commands: list[str], prefix: str) -> str:
    found = [c for c in commands if c.startswith(prefix)]
    assert len(found) == 1, f"the walk-through should have one `{prefix}` command: {found}"
    return found[0]


def _option(command: str, name: str) -> str:
    argv = shlex.split(command)
    return argv[argv.index(name) + 1]


def test_the_walkthrough_is_one_machine_with_nothing_to_export() -> None:
    commands = walkthrough((ROOT / "docs" / "cluster.md").read_text())
    assert [c.split()[2:4] for c in commands] == [
        ["tandem", "midtrain"],
        ["ray", "get-auth-token"],
        ["ray", "start"],
        ["tandem", "train"],
        ["tandem", "workers"],
        ["tandem", "workers"],
        ["tandem", "workers"],
        ["ray", "stop"],
    ]
    # a single 2-core node holds the actors as sized in the train command
    assert "rl.ray.worker_cpus=0.5" in _command(commands, "uv run tandem train")
    assert not any("=" in c.split()[0] for c in commands)  # no VAR=value prefix
    # train starts from what midtrain wrote, and the workers commands name that run
    config = _option(_command(commands, "uv run tandem midtrain"), "-c")
    assert _option(_command(commands, "uv run tandem train"), "-c") == config
    run = load_config(PipelineConfig, ROOT / config).run.name
    for c in commands:
        if c.startswith("uv run tandem workers"):
            assert _option(c, "--run") == run, c


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _of_this_head(p: psutil.Process, marker: str) -> bool:
    """Whether ``p`` names ``marker`` (this test's Ray temp directory) in its command line or
    has it as its ``RAY_TMPDIR``: Ray's client server, detached from the head, does only the
    latter."""
    if any(marker in a for a in p.info["cmdline"] or []):
        return True
    return p.environ().get("RAY_TMPDIR") == marker


def _stop_processes_of(marker: str) -> None:
    """SIGKILL every process of this test's head node (see `_of_this_head`), with its
    descendants: the head node's processes and their workers."""
    me = psutil.Process()
    skip = {me.pid, *(p.pid for p in me.parents())}
    found: dict[int, psutil.Process] = {}
    for p in psutil.process_iter(["cmdline"]):
        try:
            if p.pid not in skip and _of_this_head(p, marker):
                found[p.pid] = p
                found.update((c.pid, c) for c in p.children(recursive=True))
        except psutil.Error:
            continue
    for p in found.values():
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(list(found.values()), timeout=10)


class Walkthrough:
    """The README's commands with this test's port, sizes and environment."""

    def __init__(self, tmp: Path, ray_tmp: Path, commands: list[str]) -> None:
        self.port = _free_port()
        self.runs = tmp / "runs"
        self.ray_tmp = ray_tmp
        home = tmp / "home"
        home.mkdir()
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "AWS_"))}
        self.env.update(HOME=str(home), RAY_TMPDIR=str(self.ray_tmp), PYTHONUNBUFFERED="1")
        self.env["UV_CACHE_DIR"] = os.environ.get("UV_CACHE_DIR") or _uv_cache()
        self.commands = [c.replace("6379", str(self.port)) for c in commands]
        self.run_name = _option(_command(commands, "uv run tandem workers add"), "--run")

    def argv(self, prefix: str) -> list[str]:
        argv = shlex.split(_command(self.commands, prefix))
        argv[0] = UV
        if argv[2] == "tandem" and argv[3] == "midtrain":
            argv += ["--set", f"run.output_dir={self.runs}"]
        if argv[2] == "tandem" and argv[3] == "train":
            for setting in [*SMALL, f"run.output_dir={self.runs}"]:
                argv += ["--set", setting]
        return argv

    def run(self, prefix: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(prefix),
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def start(self, prefix: str, log: Path) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            self.argv(prefix),
            cwd=ROOT,
            env=self.env,
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, as a terminal's foreground job
        )

    def metrics(self) -> list[dict]:
        path = self.runs / self.run_name / "rl" / "metrics.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _uv_cache() -> str:
    out = subprocess.run([UV, "cache", "dir"], capture_output=True, text=True, check=True)
    return out.stdout.strip()


@pytest.fixture
def walk(tmp_path: Path) -> Iterator[Walkthrough]:
    # Ray's socket paths must stay under 108 bytes: a short directory, not pytest's
    short = Path(tempfile.mkdtemp(prefix="tandem-ray-"))
    w = Walkthrough(tmp_path, short, walkthrough((ROOT / "docs" / "cluster.md").read_text()))
    try:
        yield w
    finally:
        _stop_processes_of(str(w.ray_tmp))
        shutil.rmtree(short, ignore_errors=True)


def _wait(what: str, ok, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if proc.poll() is not None:
            pytest.fail(
                f"train ended ({proc.returncode}) before {what}:\n{log.read_text()[-3000:]}"
            )
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout:g} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)


def _done(r: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert r.returncode == 0, f"{shlex.join(r.args)} failed:\n{r.stdout[-2000:]}{r.stderr[-3000:]}"
    return r


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_cluster_walkthrough_runs_as_written(walk: Walkthrough, tmp_path: Path) -> None:
    t0 = time.monotonic()
    figures: dict[str, float | str] = {}
    if MIDTRAINED:
        shutil.copytree(MIDTRAINED, walk.runs / walk.run_name / "midtrained")
    else:
        _done(walk.run("uv run tandem midtrain", timeout=600))
    figures["midtrain_s"] = round(time.monotonic() - t0, 1)
    _done(walk.run("uv run ray get-auth-token"))
    head = _done(walk.run("uv run ray start", timeout=180))
    assert "Token authentication is enabled" in head.stdout + head.stderr

    log = tmp_path / "train.log"
    t_train = time.monotonic()
    train = walk.start("uv run tandem train", log)
    try:
        _wait("a first RL step", lambda: len(walk.metrics()) >= 1, train, log, 600)
        figures["first_step_s"] = round(time.monotonic() - t_train, 1)
        added = _done(walk.run("uv run tandem workers add"))
        assert "3 rollout workers wanted" in added.stdout, added.stdout
        shown = _done(walk.run("uv run tandem workers show"))
        pending = "pending" in shown.stdout
        free_cpus = psutil.cpu_count() - 2  # one trainer rank of 1 CPU, 2 workers of 0.5
        if free_cpus < 0.5:  # the node has no room for the third: pending, with a warning
            assert pending and "1 pending" in added.stdout, (added.stdout, shown.stdout)
            assert "pending: each declares 0.5 CPU" in added.stderr, added.stderr
        figures["added"] = shown.stdout.strip()
        removed = _done(walk.run("uv run tandem workers remove"))
        assert "2 rollout workers wanted" in removed.stdout, removed.stdout
        figures["removed"] = removed.stdout.strip()
        _wait("two RL steps", lambda: len(walk.metrics()) >= 2, train, log, 600)
        figures["two_steps_s"] = round(time.monotonic() - t_train, 1)
        os.killpg(train.pid, signal.SIGINT)  # Ctrl-C
        rc = train.wait(timeout=180)
    finally:
        if train.poll() is None:
            os.killpg(train.pid, signal.SIGKILL)
    out = log.read_text()
    assert rc == 128 + signal.SIGINT, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    last = out.strip().splitlines()[-1]
    steps = [m["step"] for m in walk.metrics()]
    assert re.fullmatch(
        rf"tandem train: stopped by SIGINT after {len(steps)} steps; checkpoint in .*; "
        "the same command resumes from it",
        last,
    ), last
    for m in walk.metrics():  # each step trained and published a new version
        assert m["step_applied"] and not m.get("publish_failed"), m
    assert [m["policy_version"] for m in walk.metrics()] == [s + 1 for s in steps]

    # the same command resumes: to one step more than were done
    t_resume = time.monotonic()
    resumed = [*walk.argv("uv run tandem train"), "--set", f"rl.steps={len(steps) + 1}"]
    again = subprocess.run(
        resumed, cwd=ROOT, env=walk.env, capture_output=True, text=True, timeout=600
    )
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    assert "rl.resumed" in again.stdout + again.stderr
    after = walk.metrics()
    assert [m["step"] for m in after] == [*steps, len(steps)]
    assert after[-1]["policy_version"] == len(steps) + 1
    figures["resume_s"] = round(time.monotonic() - t_resume, 1)
    figures["total_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(figures), file=sys.stderr)
