"""Importing a library has no global side effects, and no package import loads torch: names
are imported on first use, so configs load (and fail on bad values) before torch does.

Each import runs in a fresh interpreter, so what one package's import does cannot hide
behind what the test process already loaded.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from importlib import import_module
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARIES = {
    "tandem.moe_determinism": "packages/moe-determinism",
    "tandem.grpo": "packages/grpo",
    "tandem.delta_sync": "packages/delta-sync",
    "tandem.agent_env": "packages/agent-env",
    "tandem.orchestrator": "packages/orchestrator",
    "tandem.app": "apps/tandem",
}


@pytest.mark.parametrize("module", list(LIBRARIES))
def test_version_matches_metadata(module: str) -> None:
    member = LIBRARIES[module]
    meta = tomllib.loads((ROOT / member / "pyproject.toml").read_text())
    assert import_module(module).__version__ == meta["project"]["version"]


def torch_loaded_after(code: str) -> bool:
    """Whether a fresh interpreter has torch loaded after running ``code`` (which must pass)."""
    script = f"import sys\n{code}\nprint(int('torch' in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip() == "1"


@pytest.mark.parametrize("module", list(LIBRARIES))
def test_import_has_no_global_side_effects(module: str) -> None:
    """No logging configuration, no environment change, no torch."""
    code = (
        "import logging, os; env = dict(os.environ)\n"
        f"import {module}\n"
        "assert not logging.getLogger().handlers, 'root logger configured at import'\n"
        "assert dict(os.environ) == env, 'environment changed at import'"
    )
    assert not torch_loaded_after(code), f"{module} must import without torch"


def test_the_run_config_loads_without_torch() -> None:
    """The run config nests the libraries' own configs (MoEConfig, GRPOConfig, EnvConfig);
    loading the demo's and checking its values needs no torch."""
    demo = str(ROOT / "configs" / "demo.toml")
    code = (
        "from tandem.app.config import load_config\n"
        "from tandem.app.pipeline_config import PipelineConfig\n"
        f"c = load_config(PipelineConfig, {demo!r})\n"
        "assert c.model.vocab_size == 266 and c.trainer.loss.clip_eps_high == 0.28\n"
        "assert c.env.sandbox.limits.pids > 0"
    )
    assert not torch_loaded_after(code), "loading the run config imported torch"


def _tandem_imports(path: Path) -> list[tuple[str, str, int]]:
    """Every ``from tandem.x import name`` in ``path``, at any depth (the benchmarks import
    inside their stages, so an import error shows only when that stage runs)."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tandem."):
            found += [(node.module, alias.name, node.lineno) for alias in node.names]
    return found


@pytest.mark.parametrize(
    "script", sorted(p.name for p in (ROOT / "benchmarks").glob("*.py")), ids=str
)
def test_every_benchmark_imports_names_that_exist(script: str) -> None:
    """The benchmarks run outside the suite; a name moved in a library must not break them
    silently. (A module name that fails to import is a failure too.)"""
    missing = []
    for module, name, line in _tandem_imports(ROOT / "benchmarks" / script):
        try:
            imported = import_module(module)
        except ImportError as e:
            missing.append(f"line {line}: {module} ({e})")
            continue
        if not hasattr(imported, name):
            try:
                import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"line {line}: {module}.{name}")
    assert not missing, f"benchmarks/{script} imports what does not exist: {missing}"
