"""Where a run's engines and trainer live: in this process (``local``), the engine in a child
process (``process``) or on a Ray cluster (``ray``), chosen by ``rl.backend``.

Each backend is a module with a ``build(start, *, policy, config, tasks, run_dir)`` that
returns a `tandem.orchestrator.protocols.Backend`; `RLRun` drives every one the same way. A
new backend is one new module and one entry in `BACKENDS`.
"""

from __future__ import annotations

from importlib import import_module
from pathlib import Path

from tandem.moe_determinism import MoETransformer
from tandem.orchestrator.config import RunConfig
from tandem.orchestrator.protocols import Backend, BackendStart
from tandem.orchestrator.rollout.tasks import TaskSource

BACKENDS = {
    "local": "tandem.orchestrator.backends.local",
    "process": "tandem.orchestrator.backends.local",
    "ray": "tandem.orchestrator.backends.ray",
}


def build_backend(
    start: BackendStart,
    *,
    policy: MoETransformer,
    config: RunConfig,
    tasks: TaskSource,
    run_dir: Path,
) -> Backend:
    """The backend of ``config.rl.backend`` for a run starting at ``start``; the run trains
    ``policy`` (it holds the final weights once the backend is closed)."""
    module = import_module(BACKENDS[config.rl.backend])
    return module.build(start, policy=policy, config=config, tasks=tasks, run_dir=run_dir)
