"""Mid-training text: real Python source found on the machine, packed into training windows.

The Python standard library is real, varied code present wherever Python is, so the first
stage needs no download. Files are split into train and held-out sets by a hash of their
path (stable across machines and runs), shuffled by seed, tokenized and packed end to end
with ``<|eos|>`` separators into fixed-length windows.
"""

from __future__ import annotations

import hashlib
import random
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from tandem.orchestrator.inference.template_chat import HFTokenizer
from tandem.orchestrator.inference.tokenizer import ByteTokenizer

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


class CorpusError(RuntimeError):
    """No usable source files were found where they were expected."""


def stdlib_root() -> Path:
    """The directory of this interpreter's standard library (from `sysconfig`)."""
    return Path(sysconfig.get_paths()["stdlib"])


def find_python_files(root: Path | None = None, *, max_file_bytes: int = 200_000) -> list[Path]:
    """Sorted ``.py`` files under ``root`` (default: the stdlib), skipping tests and installs."""
    root = root or stdlib_root()
    if not root.is_dir():
        raise CorpusError(f"source directory {root} does not exist")
    files = [
        p
        for p in root.rglob("*.py")
        if not _SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])
        and 0 < p.stat().st_size <= max_file_bytes
    ]
    if not files:
        raise CorpusError(f"no Python files found under {root}")
    return sorted(files)


def is_held_out(path: Path, root: Path, fraction: float) -> bool:
    """Deterministic split by a hash of the path relative to ``root``."""
    digest = hashlib.blake2b(str(path.relative_to(root)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < fraction


def read_documents(
    files: Iterable[Path], *, seed: int, max_bytes: int | None = None
) -> Iterator[str]:
    """Yield file texts in a seeded order, stopping after ``max_bytes`` of text in total."""
    order = list(files)
    random.Random(seed).shuffle(order)
    total = 0
    for path in order:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        yield text
        total += len(text)
        if max_bytes is not None and total >= max_bytes:
            return


def pack_windows(
    documents: Iterable[list[int]], *, window: int, eos_id: int
) -> Iterator[np.ndarray]:
    """Concatenate documents (each followed by ``eos_id``) and cut windows of ``window`` ids.

    Every id appears in exactly one window; the final partial window is dropped.
    """
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    buf: list[int] = []
    for doc in documents:
        buf.extend(doc)
        buf.append(eos_id)
        while len(buf) >= window:
            yield np.asarray(buf[:window], dtype=np.int64)
            del buf[:window]


def code_windows(
    tokenizer: ByteTokenizer | HFTokenizer,
    *,
    window: int,
    seed: int,
    max_bytes: int | None,
    held_out_fraction: float = 0.05,
    split: str = "train",
    root: Path | None = None,
    eos_id: int | None = None,
) -> Iterator[np.ndarray]:
    """Packed token windows of real Python source for ``split`` ("train" or "held_out"),
    documents separated by ``eos_id`` (default: the byte tokenizer's ``<|eos|>``)."""
    if split not in ("train", "held_out"):
        raise ValueError(f"split must be 'train' or 'held_out', not {split!r}")
    root = root or stdlib_root()
    want_held = split == "held_out"
    files = [
        p for p in find_python_files(root) if is_held_out(p, root, held_out_fraction) == want_held
    ]
    docs = (tokenizer.encode(t) for t in read_documents(files, seed=seed, max_bytes=max_bytes))
    eos = tokenizer.special("<|eos|>") if eos_id is None else eos_id
    return pack_windows(docs, window=window, eos_id=eos)
