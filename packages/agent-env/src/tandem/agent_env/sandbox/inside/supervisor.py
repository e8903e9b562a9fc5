"""Per-episode supervisor: runs inside the sandbox, serves tool requests over stdin/stdout.

One long-lived process per episode keeps tool latency at a fork+exec per command instead of a
sandbox start per command. Protocol: one JSON object per line in each direction. The ``bash``
tool runs in the episode's persistent shell (``shell.py``); other commands (visible tests,
search) run in a fresh ``bash -c`` or exec in their own session with per-command rlimits; both
have a wall deadline and a cap on how much output is read. File tools run here directly and
refuse any path that resolves outside the workspace (``files.py``).

Stdlib only, Python >= 3.8: this runs on the sandbox's system interpreter. It starts once per
episode, so it avoids heavy imports (json pulls in re, enum, collections: more than the
interpreter's own start-up) and carries a minimal JSON codec instead; forked from the fork
server, where ``json`` is loaded already, it uses that.
"""

import _signal as signal  # the enum-free core of `signal`: a much cheaper import
import os
import resource
import select
import sys
import time

try:
    from . import files
    from .capture import capped_text, keep_head_tail
    from .files import ToolFailure
    from .jsonlite import dumps, loads
    from .lockdown import not_dumpable, own_keyring
    from .shell import Shell, reap_orphans, write_small
except ImportError:  # run as a script (python -I leaves the script's directory off sys.path)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import files
    from capture import capped_text, keep_head_tail
    from files import ToolFailure
    from jsonlite import dumps, loads
    from lockdown import not_dumpable, own_keyring
    from shell import Shell, reap_orphans, write_small

if "json" in sys.modules:  # a warm interpreter (the fork server's) has loaded the C codec
    import json

    dumps, loads = json.dumps, json.loads  # the same wire format, ~5x cheaper

# Set by main() from the JSON config in argv[1]; importing this module has no side effects.
CFG = {}
WS = "/workspace"
SHELL = "/bin/bash"
ENV = {}
SHELLS = []  # the episode's persistent shell, started on first use
REAP_FD = -1  # as its sandbox's init (pid 1): the SIGCHLD wake-up pipe for reaping orphans


def _limit(res, value):
    if value:
        resource.setrlimit(res, (int(value), int(value)))


def _child(argv, wfd, cpu_s):
    # Runs in the forked child: new session, fresh signal state, limits, then exec.
    try:
        os.setsid()
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        if cpu_s:
            resource.setrlimit(resource.RLIMIT_CPU, (int(cpu_s), int(cpu_s) + 1))
        try:  # noqa: SIM105 - contextlib is a costly import here
            write_small("/proc/self/oom_score_adj", b"1000")
        except OSError:
            pass
        os.chdir(WS)
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(wfd, 1)
        os.dup2(wfd, 2)
        os.closerange(3, 65536)
        os.execvpe(argv[0], argv, ENV)
    except BaseException as e:
        try:
            os.write(2, (f"exec failed: {e}\n").encode())
        finally:
            os._exit(127)


def _spawn_simple(argv, wfd, cpu_s):
    """posix_spawn (no page-table copy of this interpreter); the CPU limit is set right after
    the start, which is exact for a program that starts no others."""
    pid = os.posix_spawnp(
        argv[0],
        argv,
        ENV,
        file_actions=[
            (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
            (os.POSIX_SPAWN_DUP2, wfd, 1),
            (os.POSIX_SPAWN_DUP2, wfd, 2),
        ],
        setsid=True,
        setsigdef=(signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGTERM),
    )
    if cpu_s:
        try:  # noqa: SIM105 - contextlib is a costly import here
            resource.prlimit(pid, resource.RLIMIT_CPU, (int(cpu_s), int(cpu_s) + 1))
        except ProcessLookupError:
            pass
    return pid


def run(req):
    """Run one command; return exit status, timing and head+tail of its output."""
    argv = req.get("argv") or [SHELL, "-c", req["cmd"]]
    timeout = float(req.get("timeout", CFG.get("timeout", 30)))
    head_cap = int(req.get("head", CFG.get("head", 5000)))
    tail_cap = int(req.get("tail", CFG.get("tail", 5000)))
    max_stream = int(CFG.get("max_stream", 16 << 20))
    rfd, wfd = os.pipe()
    t0 = time.monotonic()
    if req.get("argv"):  # a program that does not fork (grep): vfork+exec, limits after
        pid = _spawn_simple(argv, wfd, CFG.get("cpu"))
    else:
        pid = os.fork()
        if pid == 0:
            os.close(rfd)
            _child(argv, wfd, CFG.get("cpu"))
    os.close(wfd)
    head = bytearray()
    tail = bytearray()
    total = 0
    timed_out = over = False
    status = None
    pidfd = os.pidfd_open(pid)
    poller = select.poll()
    poller.register(rfd, select.POLLIN)
    poller.register(pidfd, select.POLLIN)
    if REAP_FD >= 0:  # a long command's orphans are collected while it runs
        poller.register(REAP_FD, select.POLLIN)
    deadline = t0 + timeout
    drain_until = None
    pipe_open = True
    while True:
        now = time.monotonic()
        if status is not None and (not pipe_open or now >= drain_until):
            break
        if status is None and now >= deadline:
            timed_out = True
            _killpg(pid)
            status = os.waitpid(pid, 0)[1]
            break
        limit = deadline if status is None else drain_until
        for fd, _ in poller.poll(max(0, int((limit - now) * 1000)) + 1):
            if fd == REAP_FD:
                reap_orphans(_children(pid if status is None else 0), REAP_FD)
            elif fd == pidfd and status is None:
                status = os.waitpid(pid, 0)[1]
                poller.unregister(pidfd)
                _killpg(pid)  # background jobs of the command go with it
                drain_until = time.monotonic() + 0.2
            elif fd == rfd and pipe_open:
                chunk = os.read(rfd, 1 << 16)
                if not chunk:
                    pipe_open = False
                    poller.unregister(rfd)
                    continue
                total += len(chunk)
                keep_head_tail(head, tail, chunk, head_cap, tail_cap)
                if total > max_stream and not over:
                    over = True
                    _killpg(pid)
    os.close(rfd)
    os.close(pidfd)
    return {
        "output": capped_text(head, tail, total, tail_cap),
        "exit_code": os.waitstatus_to_exitcode(status),
        "timed_out": timed_out,
        "output_limit": over,
        "bytes": total,
        "seconds": time.monotonic() - t0,
    }


def shell(req):
    """Run a command in the episode's persistent shell (state kept between calls)."""
    if not SHELLS:
        SHELLS.append(Shell(SHELL, WS, ENV, CFG.get("cpu"), CFG.get("pid_namespace"), REAP_FD))
    return SHELLS[0].run(
        req["cmd"],
        float(req.get("timeout", CFG.get("timeout", 30))),
        int(req.get("head", CFG.get("head", 5000))),
        int(req.get("tail", CFG.get("tail", 5000))),
        int(CFG.get("max_stream", 16 << 20)),
    )


def _children(pid):
    """The children this supervisor waits for itself: a command's and the shell."""
    keep = [pid] if pid else []
    if SHELLS and SHELLS[0].pid:
        keep.append(SHELLS[0].pid)
    return keep


def _killpg(pid):
    try:  # noqa: SIM105 - contextlib is a costly import here
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def search(req):
    real = files.resolve(req.get("path") or ".")
    argv = ["grep", "-rnIE", "--color=never"]
    if req.get("glob"):
        argv += ["--include", req["glob"]]
    argv += ["-e", req["pattern"]]
    rel = os.path.relpath(real, WS)
    if rel != ".":  # without an operand grep searches the cwd and prints bare relative paths
        argv += ["--", rel]
    res = run({"argv": argv, "timeout": req.get("timeout", 20)})  # the host waits a bit more
    lines = res["output"].splitlines()
    cap = int(CFG.get("max_matches", 200))
    if res["exit_code"] == 1 and not lines:
        res["output"] = "(no matches)"
    elif len(lines) > cap:
        res["output"] = (
            "\n".join(lines[:cap]) + f"\n[... {len(lines) - cap} more matching lines omitted ...]"
        )
    return res


OPS = {
    "search": search,
    "exec": run,
    "shell": shell,
    "read_file": files.read_file,
    "write_file": files.write_file,
    "edit": files.edit,
    "list_dir": files.list_dir,
}


def _on_sigchld(signum, frame):
    pass  # the wake-up pipe says it; reaping happens where the supervisor polls


def _become_reaper():
    """The supervisor is its sandbox's init: orphans are re-parented to it. SIGCHLD writes
    to a wake-up pipe that the command loops poll, so they are collected at once."""
    global REAP_FD
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, _on_sigchld)
    REAP_FD = r


def main():
    """A supervisor of its own (a bwrap sandbox): the lockdown a fork-server job gets from
    the server (``lockdown.py``), then serve."""
    cfg = loads(sys.argv[1])
    if cfg.get("pid_namespace"):
        own_keyring()
        not_dumpable()
    serve(cfg)


def serve(cfg):
    """Answer requests from stdin on stdout until stdin closes (fd 1 then goes to /dev/null,
    so nothing but answers reaches the host). Requests and answers go through os.read and
    os.write directly (see request_lines)."""
    global CFG, WS, SHELL, ENV
    CFG = cfg
    if CFG.get("pid_namespace") and os.getpid() == 1 and os.getuid() != 0:
        _become_reaper()
    WS = os.path.realpath(CFG["workspace"])
    files.configure(WS, CFG)
    os.chdir(WS)  # where the shell and other commands start
    SHELL = CFG.get("shell", "/bin/bash")
    ENV = CFG.get("env", {})
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # oversized writes fail with EFBIG instead
    _limit(resource.RLIMIT_FSIZE, CFG.get("fsize"))
    _limit(resource.RLIMIT_NOFILE, CFG.get("nofile"))
    _limit(resource.RLIMIT_AS, CFG.get("as"))  # without cgroups (rootless) only
    _limit(resource.RLIMIT_NPROC, CFG.get("nproc"))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    out = os.dup(1)
    null = os.open("/dev/null", os.O_WRONLY)
    os.dup2(null, 1)
    reaped = select.poll()  # whether SIGCHLD has come since the last reaping (no read to fail)
    if REAP_FD >= 0:
        reaped.register(REAP_FD, select.POLLIN)
    send_line(out, dumps({"ok": True, "ready": True, "pid": os.getpid()}))
    for line in request_lines(0):
        try:
            req = loads(line.decode())
            resp = OPS[req["op"]](req)
            resp["ok"] = True
        except ToolFailure as e:
            resp = {"ok": False, "error": str(e)}
        except OSError as e:
            resp = {"ok": False, "error": f"{type(e).__name__}: {e.strerror or e}"}
        except Exception as e:  # any request the host sends gets an answer
            resp = {"ok": False, "error": f"bad request: {type(e).__name__}: {str(e)[:200]}"}
        send_line(out, dumps(resp))
        if REAP_FD >= 0 and reaped.poll(0):
            reap_orphans(_children(0), REAP_FD)
    for sh in SHELLS:
        sh.close()


def request_lines(fd):
    """The request lines arriving on ``fd`` (without their newline), read with os.read: a
    text stream would decode, copy and account for every request through io's layers, more
    Python work per call and, in a job forked from the fork server, more pages copied. A
    line cut off by the end of the stream is dropped (its sender is gone)."""
    pending = []
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            if end < 0:
                break
            if pending:  # a long request (a large write_file) arrives in several reads
                pending.append(chunk[start:end])
                yield b"".join(pending)
                pending = []
            else:
                yield chunk[start:end]
            start = end + 1
        if start < len(chunk):
            pending.append(chunk[start:])


def send_line(fd, text):
    """Write ``text`` and a newline to ``fd`` in as few write(2) calls as it takes."""
    data = (text + "\n").encode()
    while data:
        data = data[os.write(fd, data) :]


if __name__ == "__main__":
    main()
