"""The file tools of the supervisor (read, write, edit, list): run in its process, on paths
that must resolve inside the workspace.

Stdlib only, as the rest of the in-sandbox side; the supervisor calls `configure` with the
workspace and its config before serving.
"""

import os
import stat

WS = "/workspace"
CFG = {}


class ToolFailure(Exception):
    """An agent-facing error: reported back as the observation, never fatal."""


def configure(workspace, cfg):
    global WS, CFG
    WS, CFG = workspace, cfg


def resolve(path, must_exist=True):
    """Map a tool path to a real path inside the workspace, or refuse."""
    if not isinstance(path, str) or not path:
        raise ToolFailure("path must be a non-empty string")
    full = path if os.path.isabs(path) else os.path.join(WS, path)
    real = os.path.realpath(full)
    if real != WS and not real.startswith(WS + os.sep):
        raise ToolFailure(
            f"refused: {_short(path)!r} resolves to {_short(real)!r}, outside the workspace {WS}"
        )
    if must_exist and not os.path.exists(real):
        raise ToolFailure(f"no such file or directory: {_short(path)}")
    return real


def _short(text, limit=200):
    return text if len(text) <= limit else text[:limit] + "..."


def _open_regular(real, flags, mode=0o644):
    """Open a regular file only: a FIFO, socket or device would block or misbehave, so it is
    refused (O_NONBLOCK: opening a FIFO does not wait for a writer; fstat then tells)."""
    try:
        st = os.lstat(real)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode) and not stat.S_ISDIR(st.st_mode):
        raise ToolFailure(f"{_rel(real)} is not a regular file")
    try:
        fd = os.open(real, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno in (6, 19, 40):  # ENXIO, ENODEV, ELOOP: a socket, a device, a swapped link
            raise ToolFailure(f"{_rel(real)} is not a regular file") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ToolFailure(f"{_rel(real)} is not a regular file")
    os.set_blocking(fd, True)
    return fd


def _rel(real):
    return os.path.relpath(real, WS)


def _read_text(real, max_bytes):
    if os.path.isdir(real):
        raise ToolFailure(f"{_rel(real)} is a directory; use list_dir")
    fd = _open_regular(real, os.O_RDONLY)
    with os.fdopen(fd, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ToolFailure(
            f"{_rel(real)} is larger than {max_bytes} bytes; read it with bash (head, sed -n)"
        )
    if b"\0" in data:
        raise ToolFailure(f"{_rel(real)} is a binary file ({len(data)} bytes)")
    return data.decode("utf-8", "replace")


def read_file(req):
    real = resolve(req["path"])
    lines = _read_text(real, int(CFG.get("max_file_bytes", 4 << 20))).splitlines()
    start = max(1, int(req.get("start_line") or 1))
    end = int(req.get("end_line") or len(lines))
    end = min(end, len(lines))
    cap = int(CFG.get("head", 5000)) + int(CFG.get("tail", 5000))
    out = []
    size = 0
    for n in range(start, end + 1):
        line = f"{n:6d}\t{lines[n - 1]}"
        size += len(line) + 1
        if size > cap:
            out.append(
                f"[... truncated at line {n} of {len(lines)}; pass start_line to read on ...]"
            )
            break
        out.append(line)
    if not lines:
        return {"output": "(empty file)"}
    if end < start:
        raise ToolFailure(f"end_line {end} is before start_line {start}")
    if start > len(lines):
        raise ToolFailure(f"start_line {start} is past the end ({len(lines)} lines)")
    return {"output": "\n".join(out)}


def write_file(req):
    real = resolve(req["path"], must_exist=False)
    if os.path.isdir(real):
        raise ToolFailure(f"{_rel(real)} is a directory")
    os.makedirs(os.path.dirname(real), exist_ok=True)
    data = req["content"].encode("utf-8")
    fd = _open_regular(real, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return {"output": f"wrote {len(data)} bytes to {_rel(real)}"}


def edit(req):
    real = resolve(req["path"])
    text = _read_text(real, int(CFG.get("max_file_bytes", 4 << 20)))
    old, new = req["old_string"], req["new_string"]
    if not old:
        raise ToolFailure("old_string must not be empty")
    count = text.count(old)
    if count == 0:
        raise ToolFailure(
            f"old_string not found in {_rel(real)} (it must match exactly, whitespace included)"
        )
    if count > 1:
        raise ToolFailure(
            f"old_string matches {count} times in {_rel(real)}; include more context so it matches once"
        )
    at = text.index(old)
    text = text[:at] + new + text[at + len(old) :]
    fd = _open_regular(real, os.O_WRONLY | os.O_TRUNC)
    with os.fdopen(fd, "wb") as f:
        f.write(text.encode("utf-8"))
    first = text.count("\n", 0, at) + 1
    lines = text.splitlines()
    lo, hi = max(1, first - 2), min(len(lines), first + new.count("\n") + 2)
    snippet = "\n".join(f"{n:6d}\t{lines[n - 1]}" for n in range(lo, hi + 1))
    return {"output": f"edited {_rel(real)}:\n{snippet}"}


def list_dir(req):
    real = resolve(req.get("path") or ".")
    if not os.path.isdir(real):
        raise ToolFailure(f"{_rel(real)} is not a directory")
    depth = max(1, min(int(req.get("depth") or 1), 5))
    cap = int(CFG.get("max_entries", 400))
    out = []
    base_depth = real.rstrip(os.sep).count(os.sep)
    for root, dirs, files in os.walk(real):
        dirs.sort()
        rel_root = os.path.relpath(root, real)
        entries = [d + "/" for d in dirs] + sorted(files)
        if root.rstrip(os.sep).count(os.sep) - base_depth + 1 >= depth:
            dirs[:] = []
        for name in entries:
            out.append(name if rel_root == "." else os.path.join(rel_root, name))
            if len(out) >= cap:
                out.append("[... more entries omitted ...]")
                return {"output": "\n".join(out)}
    return {"output": "\n".join(out) if out else "(empty directory)"}
