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
