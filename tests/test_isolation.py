"""Each package, built as a wheel and installed alone outside the workspace, must import.

This catches a package that silently needs a sibling it does not declare, and checks that
the torch-free packages really install and import without torch. The wheels come from
`uv build --all-packages`, as a user builds them, and each carries what a published
distribution should: ``py.typed``, the license, its project URLs and classifiers. The app's
wheel, installed in a fresh environment, runs the demo the checkout runs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
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
APP = "tandem-rl"
MODULES = {**{d: m for d, (m, _) in PACKAGES.items()}, APP: "tandem.app"}


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
    _run([_uv(), "build", "--all-packages", "--out-dir", str(out)], cwd=ROOT)
    return out


def _wheel(wheelhouse: Path, dist: str) -> Path:
    wheels = sorted(wheelhouse.glob(f"{dist.replace('-', '_')}-*.whl"))
    assert len(wheels) == 1, f"expected one wheel for {dist}, found {wheels}"
    return wheels[0]


def _fresh_venv(tmp_path: Path, wheelhouse: Path, constraints: Path, wheel: Path) -> Path:
    """A new virtual environment with ``wheel`` installed; siblings come only from the
    wheelhouse, so a dependency missing from the metadata shows up as an error."""
    venv = tmp_path / "venv"
    _run([_uv(), "venv", "--python", sys.executable, str(venv)], cwd=tmp_path)
    py = venv / "bin" / "python"
    install = [_uv(), "pip", "install", "--python", str(py), "--find-links", str(wheelhouse)]
    _run([*install, "--constraint", str(constraints), str(wheel)], cwd=tmp_path)
    return venv


@pytest.mark.parametrize("dist", list(MODULES))
def test_every_wheel_carries_types_license_urls_and_classifiers(
    dist: str, wheelhouse: Path
) -> None:
    with zipfile.ZipFile(_wheel(wheelhouse, dist)) as wheel:
        names = wheel.namelist()
        assert MODULES[dist].replace(".", "/") + "/py.typed" in names
        licenses = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        assert licenses and wheel.read(licenses[0]) == (ROOT / "LICENSE").read_bytes()
        meta = wheel.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in meta
    urls = [line for line in meta.splitlines() if line.startswith("Project-URL: ")]
    assert {u.split(": ")[1].split(",")[0] for u in urls} >= {"Repository", "Changelog"}
    assert "Classifier: Typing :: Typed" in meta
    assert sum(line.startswith("Classifier: ") for line in meta.splitlines()) >= 5


def test_the_app_wheel_runs_the_demo_of_the_checkout(
    wheelhouse: Path, constraints: Path, tmp_path: Path
) -> None:
    """`tandem demo` from a wheel install, outside the checkout, resolves the same config as
    the checkout's `configs/demo.toml`: the demo's config ships with the app."""
    venv = _fresh_venv(tmp_path, wheelhouse, constraints, _wheel(wheelhouse, APP))
    installed = _run([str(venv / "bin" / "tandem"), "demo", "--dump-config"], cwd=tmp_path)
    here = _run([sys.executable, "-m", "tandem.app.cli", "demo", "--dump-config"], cwd=ROOT)
    assert installed.stdout == here.stdout
    assert 'name = "demo"' in installed.stdout and "[env.sandbox.limits]" in installed.stdout


@pytest.mark.parametrize("dist", list(PACKAGES))
def test_wheel_installs_and_imports_alone(
    dist: str, wheelhouse: Path, constraints: Path, tmp_path: Path
) -> None:
    module, needs_torch = PACKAGES[dist]
    venv = _fresh_venv(tmp_path, wheelhouse, constraints, _wheel(wheelhouse, dist))
    py = venv / "bin" / "python"
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
        " 'accelerate': importlib.util.find_spec('accelerate') is not None,"
        " 'tandem_init': importlib.util.find_spec('tandem').origin}))\n"
    )
    out = _run([str(py), "-c", probe], cwd=tmp_path).stdout
    info = json.loads(out.strip().splitlines()[-1])
    assert info["version"] == "0.1.0"
    assert str(venv) in info["file"], "imported from the workspace, not the fresh venv"
    assert info["tandem_init"] is None, "tandem must stay a PEP 420 namespace (no __init__.py)"
    if dist == "tandem-grpo":  # the losses need torch alone; accelerate is the trainer's extra
        assert info["accelerate"] is False, "tandem-grpo pulled in accelerate"
    if not needs_torch:
        assert info["torch"] is False, f"{dist} pulled in torch"
    else:
        assert info["torch"] is True
