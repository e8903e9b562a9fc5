"""A persistent bash per episode, driven by the supervisor: terminal semantics, cheap commands.

Starting ``bash -c`` costs ~5 ms of CPU per command (exec, dynamic linking, start-up); a shell
that stays up runs a builtin such as ``echo`` with no fork at all and anything else with one
fork+exec, and keeps what a user of a terminal expects: the working directory, variables and
functions persist between calls.

Protocol with the shell (fds 63, 62 and 61, closed for the commands themselves): the
supervisor writes ``<length>\\n<command>`` to fd 63 (the command as ASCII: see ``_frame``); the
shell ``eval``s it with stdin from /dev/null and stdout+stderr to the output pipe, then writes
``export -p`` to fd 61, a memfd the supervisor empties before each command, and last
``status\\0cwd\\0`` to fd 62. bash writes ``export -p`` a line per write(2): into a pipe, each
line would wake the supervisor; into the memfd none does, and the record on fd 62 is one write,
so a command's end costs the supervisor one wake-up. After each command every other process in the sandbox (background jobs,
daemons, the remains of a fork bomb) is killed, as a fresh ``bash -c`` per call used to do.

A command that exits, kills or wedges the shell (``exit``, ``kill -9 $$``, a timeout, too much
output) gets it restarted in the last known working directory with the last exported
variables; files are kept (they live in the workspace).
"""

import _signal as signal
import os
import resource
import select
import sys
import time

try:
    from .capture import capped_text, keep_head_tail
except ImportError:  # run as a script (python -I leaves the script's directory off sys.path)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from capture import capped_text, keep_head_tail

_CTL, _STATUS, _EXPORTS = 63, 62, 61
_CHILDREN = "/proc/%d/task/%d/children"
# Runs inside bash; `builtin` guards against user functions named read/eval/printf. `read -N`
# counts characters of the shell's locale; the frame is ASCII, so they are bytes in any locale
# (switching the shell to LC_ALL=C for the read instead costs ~0.1 ms of CPU per command). A
# length prefixed with `b` marks a command whose backslashes and non-ASCII bytes are escaped
# for `printf %b`, which restores its exact bytes.
_LOOP = (
    "while builtin read -r -u 63 __tandem_n; do "
    'IFS= builtin read -r -N "${__tandem_n#b}" -u 63 __tandem_c; '
    'if [[ $__tandem_n == b* ]]; then builtin printf -v __tandem_c %b "$__tandem_c"; fi; '
    'builtin eval "$__tandem_c" </dev/null 61>&- 62>&- 63>&-; __tandem_s=$?; '
    "builtin disown -a; "  # its background jobs are killed next: no "Killed" notices later
    "builtin export -p >&61; "
    'builtin printf \'%s\\0%s\\0\' "$__tandem_s" "$PWD" >&62; '
    "done"
)


# backslash and every byte >= 0x80 (as latin-1 code points) to their `printf %b` escapes
_ESCAPES = {0x5C: "\\\\", **{i: f"\\x{i:02x}" for i in range(0x80, 0x100)}}


def _frame(data):
    """The shell's frame for a command's bytes: ``<n>\\n`` and n ASCII bytes."""
    if data.isascii():
        return b"%d\n" % len(data) + data
    esc = data.decode("latin-1").translate(_ESCAPES).encode("ascii")
    return b"b%d\n" % len(esc) + esc


def read_small(path):
    """A small /proc file's bytes, with no buffered file object: in a freshly forked
    interpreter every object touched is a page copied, and io's machinery is many objects."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 4096)
    finally:
        os.close(fd)


def write_small(path, data):
    """Write ``data`` (bytes) in one write(2) to an existing file, e.g. under /proc."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _kill(pid, sig):
    try:  # noqa: SIM105 - contextlib is a costly import here
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def reap_orphans(keep, wakeup_fd=-1):
    """As the sandbox's init (pid 1), collect exited processes that were re-parented to us,
    leaving alone the children in ``keep`` (their exit status is read where they are waited
    for). Without this, orphans' zombies would count against the pids limit.
    ``wakeup_fd``: the SIGCHLD wake-up pipe that called us, drained first."""
    while wakeup_fd >= 0:
        try:
            if not os.read(wakeup_fd, 4096):
                break
        except BlockingIOError:
            break
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None:
            return
        if info.si_pid in keep:
            break  # rare: one of ours exited first; find the others by name
        try:  # noqa: SIM105 - contextlib is a costly import here
            os.waitpid(info.si_pid, os.WNOHANG)
        except ChildProcessError:
            pass
    me = str(os.getpid()).encode()
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) not in keep:
            try:
                fields = read_small(f"/proc/{name}/stat").rsplit(b")", 1)[1].split()
                if fields[0] == b"Z" and fields[1] == me:
                    os.waitpid(int(name), os.WNOHANG)
            except (OSError, IndexError):
                continue


class Shell:
    """One bash process in its own session; ``run`` executes a command in it."""

    def __init__(self, shell, workspace, env, cpu_s, pid_namespace, reap_fd=-1):
        self.argv = [shell, "--norc", "--noprofile", "-c", _LOOP]
        self.ws = workspace
        self.env = env
        self.cpu_s = cpu_s
        # kill(-1) and the /proc sweep are only safe when this sandbox has its own pid
        # namespace (and we are not root): unsandboxed, they would reach the host's processes
        self.own_pids = bool(pid_namespace) and os.getuid() != 0
        # the supervisor may be the sandbox's init itself: then orphans are ours to collect,
        # as soon as SIGCHLD writes to this wake-up pipe
        self.reap_fd = reap_fd if self.own_pids else -1
        self.pid = 0
        self.cwd = workspace
        self.exports = ""

    # -- lifecycle ------------------------------------------------------------------------

    def _spawn(self):
        ctl_r, self.ctl = os.pipe()
        self.st, st_w = os.pipe()
        self.out, out_w = os.pipe()
        self.exp = os.memfd_create("exports", os.MFD_CLOEXEC)
        # posix_spawn (vfork+exec) instead of fork: the supervisor may be a fork of a large
        # warm interpreter, whose page tables a fork would copy. The new fds are dup2'd
        # (inheritable); every other fd of ours is close-on-exec.
        try:
            pid = os.posix_spawn(
                self.argv[0],
                self.argv,
                self.env,
                file_actions=[
                    (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
                    (os.POSIX_SPAWN_DUP2, out_w, 1),
                    (os.POSIX_SPAWN_DUP2, out_w, 2),
                    (os.POSIX_SPAWN_DUP2, ctl_r, _CTL),
                    (os.POSIX_SPAWN_DUP2, st_w, _STATUS),
                    (os.POSIX_SPAWN_DUP2, self.exp, _EXPORTS),  # shares our file offset
                ],
                setsid=True,
                setsigdef=(signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGTERM),
            )
        finally:
            for fd in (ctl_r, st_w, out_w):
                os.close(fd)
        # safe after the start: the shell reads its first command before running anything
        if self.cpu_s:
            cpu = int(self.cpu_s)
            resource.prlimit(pid, resource.RLIMIT_CPU, (cpu, cpu + 1))
        try:  # noqa: SIM105 - contextlib is a costly import here
            write_small(f"/proc/{pid}/oom_score_adj", b"1000")
        except OSError:
            pass
        for fd in (self.ctl, self.st, self.out):
            os.set_blocking(fd, False)
        self.pid = pid
        self.pidfd = os.pidfd_open(pid)

    def _close(self, status=None):
        """Forget a dead (or killed) shell: reap it, close its pipes; returns its status."""
        if status is None:
            status = os.waitpid(self.pid, 0)[1]
        for fd in (self.ctl, self.st, self.out, self.exp, self.pidfd):
            os.close(fd)
        self.pid = 0
        return status

    def _start(self):
        self._spawn()
        restore = ""
        if self.exports:
            restore += self.exports + "\n"
        if self.cwd != self.ws:
            restore += "builtin cd -- " + _quote(self.cwd) + " 2>/dev/null\n"
        if restore:
            res = self._roundtrip(restore, 10.0, 0, 0, 1 << 20)
            if res["timed_out"] or res.get("shell_exited"):
                self.exports, self.cwd = "", self.ws  # the saved state is what broke it
                self._spawn()

    def _kill_all(self):
        """Kill the shell and everything else it started."""
        if self.own_pids:
            _kill(-1, signal.SIGKILL)  # every process in this sandbox but us and its init
        else:
            _kill(-self.pid, signal.SIGKILL)  # its process group

    def close(self):
        if self.pid:
            self._kill_all()
            self._close()

    # -- commands -------------------------------------------------------------------------

    def run(self, cmd, timeout, head_cap, tail_cap, max_stream):
        """Run one command; exit status, timing and head+tail of its output."""
        if "\0" in cmd:
            raise ValueError("the command contains a NUL character")
        if not self.pid:
            self._start()
        res = self._roundtrip(cmd, timeout, head_cap, tail_cap, max_stream)
        if self.pid:
            self._sweep()
        return res

    def _roundtrip(self, cmd, timeout, head_cap, tail_cap, max_stream):
        t0 = time.monotonic()
        # what processes killed after the previous call wrote late is not this call's output
        self._read_out(bytearray(), bytearray(), 0, 0, 0)
        data = cmd.encode("utf-8", "surrogateescape")  # saved state may hold raw bytes
        frame = _frame(data)
        head = bytearray()
        tail = bytearray()
        record = bytearray()
        total = 0
        timed_out = over = exited = False
        status = None
        poller = select.poll()
        poller.register(self.out, select.POLLIN)
        poller.register(self.st, select.POLLIN)
        poller.register(self.pidfd, select.POLLIN)
        # a command that fits the pipe's buffer goes out without a poll
        try:  # noqa: SIM105 - contextlib is a costly import here
            frame = frame[os.write(self.ctl, frame) :]
        except (BlockingIOError, BrokenPipeError):  # full, or the shell is gone (pidfd says)
            pass
        if frame:
            poller.register(self.ctl, select.POLLOUT)
        if self.reap_fd >= 0:  # a long command's orphans are collected while it runs
            poller.register(self.reap_fd, select.POLLIN)
        deadline = t0 + timeout
        while status is None:
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                break
            for fd, _ in poller.poll(max(0, int((deadline - now) * 1000)) + 1):
                if fd == self.ctl:
                    try:
                        frame = frame[os.write(self.ctl, frame) :]
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:  # the shell is gone: its pidfd says so next
                        frame = b""
                    if not frame:
                        poller.unregister(self.ctl)
                elif fd == self.out:
                    total = self._read_out(head, tail, head_cap, tail_cap, total)
                    if total > max_stream:
                        over = True
                elif fd == self.st:
                    try:
                        chunk = os.read(self.st, 1 << 16)
                    except BlockingIOError:
                        continue
                    record += chunk
                    if record.count(b"\0") >= 2 and record.endswith(b"\0"):
                        status = bytes(record)
                        break
                    if not chunk:
                        poller.unregister(self.st)
                elif fd == self.pidfd:
                    exited = True
                    status = b""
                    break
                elif fd == self.reap_fd:
                    reap_orphans((self.pid,), self.reap_fd)
            if over:
                break
        total = self._read_out(head, tail, head_cap, tail_cap, total)
        restarted = False
        if exited or timed_out or over:
            self._kill_all()
            code = os.waitstatus_to_exitcode(self._close())
            restarted = True
        else:
            parts = status.split(b"\0")
            code = int(parts[0])
            self.cwd = parts[1].decode("utf-8", "surrogateescape")
            size = os.lseek(self.exp, 0, os.SEEK_CUR)  # where the shell's writes ended
            self.exports = os.pread(self.exp, size, 0).decode("utf-8", "surrogateescape")
            # rewound for the next command's `export -p`; what lies past where that one ends
            # is never read, so the file is not truncated (a shmem truncation per call)
            os.lseek(self.exp, 0, os.SEEK_SET)
        return {
            "output": capped_text(head, tail, total, tail_cap),
            "exit_code": code,
            "timed_out": timed_out,
            "output_limit": over,
            "shell_exited": exited,
            "shell_restarted": restarted,
            "cwd": self.cwd.encode("utf-8", "surrogateescape").decode("utf-8", "replace"),
            "bytes": total,
            "seconds": time.monotonic() - t0,
        }

    def _read_out(self, head, tail, head_cap, tail_cap, total):
        while True:
            try:
                chunk = os.read(self.out, 1 << 16)
            except BlockingIOError:
                return total
            if not chunk:
                return total
            total += len(chunk)
            keep_head_tail(head, tail, chunk, head_cap, tail_cap)
            if len(chunk) < 1 << 16:
                return total

    def _others(self, me):
        """Live processes in this sandbox other than its init, the supervisor and the shell."""
        found = []
        for name in os.listdir("/proc"):
            if name.isdigit():
                pid = int(name)
                if pid != 1 and pid != me and pid != self.pid:
                    try:
                        state = read_small(f"/proc/{pid}/stat").rsplit(b")", 1)[1][1:2]
                    except OSError:
                        continue
                    if state != b"Z":
                        found.append(pid)
        return found

    def _alone(self, me):
        """Whether the sandbox certainly holds no process but its init, the supervisor and
        the shell, read from three children lists instead of a scan of every /proc entry.
        Every other live process descends from one of those three (an orphan goes to the
        init), so its topmost such ancestor is in one of the lists; a zombie there (or a
        kernel without the lists) sends the caller to the full scan."""
        ours = (me, self.pid)
        try:
            for pid in {1, me, self.pid}:
                if any(int(c) not in ours for c in read_small(_CHILDREN % (pid, pid)).split()):
                    return False
        except (OSError, ValueError):
            return False
        return True

    def _sweep(self):
        """Kill what the command left running (background jobs, daemons, a fork bomb)."""
        if not self.own_pids:
            return
        me = os.getpid()
        if self._alone(me):
            return
        others = self._others(me)
        rounds = 0
        while others and rounds < 100:
            rounds += 1
            _kill(-1, signal.SIGSTOP)  # freeze everything (a fork bomb stops forking)
            for pid in self._others(me):
                _kill(pid, signal.SIGKILL)
            _kill(self.pid, signal.SIGCONT)
            others = self._others(me)
            if others:
                time.sleep(0.001)
        if self.reap_fd >= 0:  # everything left is a zombie now: the orphans are ours
            reap_orphans((self.pid,), self.reap_fd)


def _quote(text):
    return "'" + text.replace("'", "'\\''") + "'"
