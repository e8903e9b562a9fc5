"""Each package, built as a wheel and installed alone outside the workspace, must import.

This catches a package that silently needs a sibling it does not declare, and checks that
the torch-free packages really install and import without torch.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "tandem-moe-determinism": ("tandem.moe_determinism", True),
    "tandem-grpo": ("tandem.grpo", True),
    "tandem-delta-sync": ("tandem.delta_sync", False),
    "tandem-agent-env": ("tandem.agent_env", False),
    "tandem-orchestrator": ("tandem.orchestrator", True),
}
WHEELS = [*PACKAGES, "tandem"]


def _uv() -> str:
    uv = os.environ.get("UV") or shutil.which("uv")
    if not uv:
        pytest.fail("the uv executable is needed to build wheels (pip install uv)")
    return uv


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "UV_PROJECT"))}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, **kw)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def constraints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The workspace's own pins (``[tool.uv] constraint-dependencies``) as a constraints file."""
    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["uv"][
        "constraint-dependencies"
    ]
    path = tmp_path_factory.mktemp("pins") / "constraints.txt"
    path.write_text("\n".join(pins) + "\n")
    return path


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheels")
    for dist in WHEELS:
        _run([_uv(), "build", "--package", dist, "--wheel", "--out-dir", str(out)], cwd=ROOT)
    return out


@pytest.mark.parametrize("dist", list(PACKAGES))
def test_wheel_installs_and_imports_alone(
    dist: str, wheelhouse: Path, constraints: Path, tmp_path: Path
) -> None:
    module, needs_torch = PACKAGES[dist]
    wheels = sorted(wheelhouse.glob(f"{dist.replace('-', '_')}-*.whl"))
    assert len(wheels) == 1, f"expected one wheel for {dist}, found {wheels}"
    venv = tmp_path / "venv"
    _run([_uv(), "venv", "--python", sys.executable, str(venv)], cwd=tmp_path)
    py = venv / "bin" / "python"
    # Siblings are only reachable through the wheelhouse, so a dependency missing from
    # the package's metadata shows up as an import error below.
    _run(
        [
            _uv(),
            "pip",
            "install",
            "--python",
            str(py),
            "--find-links",
            str(wheelhouse),
            "--constraint",
            str(constraints),
            str(wheels[0]),
        ],
        cwd=tmp_path,
    )
    # Every submodule is imported, not just the package: optional extras (vllm, ray, boto3,
    # cupy) must be imported lazily inside the functions that use them.
    probe = (
        "import importlib, importlib.util, json, pkgutil\n"
        f"m = importlib.import_module({module!r})\n"
        "subs = [i.name for i in pkgutil.walk_packages(m.__path__, m.__name__ + '.')"
        " if not i.name.endswith('.__main__')]\n"
        "for name in subs: importlib.import_module(name)\n"
        "print(json.dumps({'version': m.__version__, 'file': m.__file__, 'subs': subs,"
        " 'torch': importlib.util.find_spec('torch') is not None,"
        " 'tandem_init': importlib.util.find_spec('tandem').origin}))\n"
    )
    out = _run([str(py), "-c", probe], cwd=tmp_path).stdout
    info = json.loads(out.strip().splitlines()[-1])
    assert info["version"] == "0.1.0"
    assert str(venv) in info["file"], "imported from the workspace, not the fresh venv"
    assert info["tandem_init"] is None, "tandem must stay a PEP 420 namespace (no __init__.py)"
    if not needs_torch:
        assert info["torch"] is False, f"{dist} pulled in torch"
    else:
        assert info["torch"] is True
