"""A small, strict unified-diff applier (git-style ``a/`` ``b/`` paths).

SWE-bench records carry the hidden tests as a ``test_patch`` and the reference fix as a
``patch``; applying them on the host needs no ``patch`` or ``git`` binary. Hunks must match
exactly (a small offset search is allowed, no fuzz): a patch that does not apply is an error,
never a silently different file.
"""

from __future__ import annotations

import re
import tarfile
import zipfile
from pathlib import Path

from tandem.agent_env.errors import SandboxError
from tandem.agent_env.task import Task

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def _strip(path: str) -> str | None:
    path = path.split("\t")[0].strip()
    if path == "/dev/null":
        return None
    return path[2:] if path[:2] in ("a/", "b/") else path


def _files(patch: str) -> list[tuple[str | None, str | None, list[list[str]]]]:
    """[(old path, new path, hunks)]; a hunk is its lines including the @@ header."""
    out: list[tuple[str | None, str | None, list[list[str]]]] = []
    lines = patch.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            old, new = _strip(lines[i][4:]), _strip(lines[i + 1][4:])
            hunks: list[list[str]] = []
            i += 2
            while i < len(lines) and lines[i].startswith("@@"):
                hunk = [lines[i]]
                i += 1
                while i < len(lines) and (lines[i][:1] in (" ", "+", "-", "\\") or lines[i] == ""):
                    if (
                        lines[i].startswith("--- ")
                        and i + 1 < len(lines)
                        and lines[i + 1].startswith("+++ ")
                    ):
                        break
                    hunk.append(lines[i])
                    i += 1
                hunks.append(hunk)
            out.append((old, new, hunks))
        else:
            i += 1
    if not out:
        raise SandboxError("the patch contains no file changes (expected a unified diff)")
    return out


def patched_paths(patch: str) -> list[str]:
    return [p for old, new, _ in _files(patch) for p in [new or old] if p]


def _apply_hunks(path: str, text: str, hunks: list[list[str]]) -> str:
    src = text.split("\n")
    trailing = text.endswith("\n")
    if trailing:
        src = src[:-1]
    out: list[str] = []
    pos = 0
    for hunk in hunks:
        m = _HUNK.match(hunk[0])
        if m is None:
            raise SandboxError(f"bad hunk header in patch for {path}: {hunk[0]!r}")
        body = [ln for ln in hunk[1:] if not ln.startswith("\\")]
        before = [ln[1:] for ln in body if ln[:1] in (" ", "-") or ln == ""]
        after = [ln[1:] for ln in body if ln[:1] in (" ", "+") or ln == ""]
        want = max(int(m.group(1)) - 1, 0) if before else int(m.group(1))
        at = None
        for delta in range(0, 200):
            for cand in (want + delta, want - delta):
                if (
                    pos <= cand <= len(src) - len(before)
                    and src[cand : cand + len(before)] == before
                ):
                    at = cand
                    break
            if at is not None:
                break
        if at is None:
            raise SandboxError(f"patch hunk {hunk[0]!r} does not apply to {path}")
        out += src[pos:at] + after
        pos = at + len(before)
    out += src[pos:]
    return "\n".join(out) + ("\n" if trailing or not text else "")


def apply_patch(patch: str, files: dict[str, str | None]) -> dict[str, str | None]:
    """Apply ``patch`` to ``files`` (path -> content, None if absent); return the changed
    files (None = deleted)."""
    result: dict[str, str | None] = {}
    for old, new, hunks in _files(patch):
        path = new or old
        assert path is not None
        if new is None:
            result[path] = None
            continue
        base = "" if old is None else files.get(old)
        if base is None:
            raise SandboxError(f"the patch modifies {old}, which is not in the repository")
        result[path] = _apply_hunks(path, base, hunks)
    return result


def read_repo_file(task: Task, path: str) -> str | None:
    """A file of the task's snapshot (inline files, directory or archive), or None."""
    if path in task.files:
        return task.files[path]
    if not task.repo_path:
        return None
    repo = Path(task.repo_path)
    if repo.is_dir():
        f = repo / path
        return f.read_text() if f.is_file() else None
    if repo.name.endswith(".zip"):
        with zipfile.ZipFile(repo) as zf:
            names = zf.namelist()
            tops = {n.split("/")[0] for n in names}
            top = next(iter(tops)) + "/" if len(tops) == 1 else ""
            for cand in (path, top + path):
                if cand in names:
                    return zf.read(cand).decode()
        return None
    with tarfile.open(repo) as tf:
        names = tf.getnames()
        tops = {n.split("/")[0] for n in names}
        prefixes = ["", *(f"{t}/" for t in tops if len(tops) == 1)]
        for cand in (p + path for p in prefixes):
            try:
                member = tf.extractfile(cand)
            except KeyError:
                continue
            if member is not None:
                return member.read().decode()
    return None
