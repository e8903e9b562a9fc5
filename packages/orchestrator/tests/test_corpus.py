"""Mid-training corpus: real stdlib files, a stable split, exact packing."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from tandem.orchestrator.inference.tokenizer import ByteTokenizer
from tandem.orchestrator.midtrain.corpus import (
    CorpusError,
    code_windows,
    find_python_files,
    is_held_out,
    pack_windows,
    stdlib_root,
)


def test_finds_real_stdlib_code_without_tests() -> None:
    files = find_python_files()
    names = {p.name for p in files}
    assert {"json", "os.py"} & (names | {p.parent.name for p in files})
    assert len(files) > 200
    assert not any("site-packages" in p.parts or "test" in p.parts[:-1] for p in files)


def test_split_is_disjoint_and_stable() -> None:
    root = stdlib_root()
    files = find_python_files(root)
    held = [p for p in files if is_held_out(p, root, 0.1)]
    assert 0.03 < len(held) / len(files) < 0.2
    assert held == [p for p in files if is_held_out(p, root, 0.1)]


def test_pack_windows_keeps_every_token_once() -> None:
    docs = [[1, 2, 3], [4], [5, 6, 7, 8, 9]]
    windows = list(pack_windows(docs, window=4, eos_id=0))
    flat = np.concatenate(windows).tolist()
    assert flat == [1, 2, 3, 0, 4, 0, 5, 6, 7, 8, 9, 0]
    assert all(len(w) == 4 for w in windows)
    with pytest.raises(ValueError, match="window"):
        list(pack_windows(docs, window=1, eos_id=0))


def test_code_windows_decode_to_source_and_differ_by_split() -> None:
    tok = ByteTokenizer()
    train = list(itertools.islice(code_windows(tok, window=256, seed=0, max_bytes=50_000), 20))
    held = list(
        itertools.islice(
            code_windows(tok, window=256, seed=0, max_bytes=50_000, split="held_out"), 20
        )
    )
    assert train and held
    text = tok.decode(np.concatenate(train).tolist())
    assert "def " in text or "import " in text
    assert not {w.tobytes() for w in train} & {w.tobytes() for w in held}
    again = list(itertools.islice(code_windows(tok, window=256, seed=0, max_bytes=50_000), 20))
    assert all(np.array_equal(a, b) for a, b in zip(train, again, strict=True))


def test_missing_root_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match="does not exist"):
        find_python_files(tmp_path / "nope")
    with pytest.raises(CorpusError, match="no Python files"):
        find_python_files(tmp_path)
