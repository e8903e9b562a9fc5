"""The asynchronous RL pipeline: the stages, the run config and the run.

Where things are (each folder's ``__init__`` says more):

- ``config.py``: the run config (`RunConfig`), nesting the libraries' own configs;
- ``protocols.py``: what the RL loop drives (`Engine`, `Rollouts`, `Trainer`,
  `WeightSink`, `Backend`) and ``wire.py``: what crosses between processes;
- ``stages.py``: `midtrain_policy`, `evaluate_policy` (`EvalBeside`: beside RL), `reinforce`;
- ``inference/``: tokenizer, chat format, tool-call prefix check, the embedded engine;
- ``rollout/``: token-level episodes, groups, tasks and the curriculum;
- ``training/``: the RL trainer, scoring with router replay, sharding, weight publishing;
- ``rl/``: the loop, the staleness rule (``rl/staleness.py``), one module per schedule;
- ``backends/``: ``local`` and ``ray``; ``midtrain/``, ``eval/``, ``artifacts/``,
  ``runtime/``.

The names below are imported on first use, so `RunConfig` loads without torch.
"""

from __future__ import annotations

from importlib import import_module
from importlib.metadata import version as _version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandem.orchestrator.artifacts.metrics import read_metrics
    from tandem.orchestrator.artifacts.report import (
        fmt,
        markdown_table,
        plot_rewards,
        write_report,
    )
    from tandem.orchestrator.backends.ray.cluster import join_cluster
    from tandem.orchestrator.backends.ray.envs import RAY_NAMESPACE
    from tandem.orchestrator.backends.ray.rollouts import pool_name
    from tandem.orchestrator.config import ConfigValueError, RunConfig, RunSettings
    from tandem.orchestrator.eval.passk import (
        EvalResult,
        category_differences,
        paired_difference,
    )
    from tandem.orchestrator.inference.vllm.errors import VllmError
    from tandem.orchestrator.inference.vllm.serving import servable_head_dim
    from tandem.orchestrator.policy import PolicyError, build_model, load_policy, save_policy
    from tandem.orchestrator.rl.hooks import RunHooks
    from tandem.orchestrator.rl.loop import RLRun
    from tandem.orchestrator.rl.summary import RunSummary
    from tandem.orchestrator.runtime.allocator import reuse_freed_memory
    from tandem.orchestrator.stages import (
        EvalBeside,
        check_rl_engine,
        evaluate_policy,
        midtrain_policy,
        reinforce,
    )

__version__ = _version("tandem-orchestrator")

_HOME = {
    "ConfigValueError": "config",
    "EvalBeside": "stages",
    "EvalResult": "eval.passk",
    "PolicyError": "policy",
    "RAY_NAMESPACE": "backends.ray.envs",
    "RLRun": "rl.loop",
    "RunConfig": "config",
    "RunHooks": "rl.hooks",
    "RunSettings": "config",
    "RunSummary": "rl.summary",
    "build_model": "policy",
    "check_rl_engine": "stages",
    "evaluate_policy": "stages",
    "fmt": "artifacts.report",
    "join_cluster": "backends.ray.cluster",
    "load_policy": "policy",
    "markdown_table": "artifacts.report",
    "midtrain_policy": "stages",
    "paired_difference": "eval.passk",
    "category_differences": "eval.passk",
    "plot_rewards": "artifacts.report",
    "pool_name": "backends.ray.rollouts",
    "read_metrics": "artifacts.metrics",
    "reinforce": "stages",
    "reuse_freed_memory": "runtime.allocator",
    "save_policy": "policy",
    "servable_head_dim": "inference.vllm.serving",
    "VllmError": "inference.vllm.errors",
    "write_report": "artifacts.report",
}
__all__ = [
    "RAY_NAMESPACE",
    "ConfigValueError",
    "EvalBeside",
    "EvalResult",
    "PolicyError",
    "RLRun",
    "RunConfig",
    "RunHooks",
    "RunSettings",
    "RunSummary",
    "VllmError",
    "__version__",
    "build_model",
    "category_differences",
    "check_rl_engine",
    "evaluate_policy",
    "fmt",
    "join_cluster",
    "load_policy",
    "markdown_table",
    "midtrain_policy",
    "paired_difference",
    "plot_rewards",
    "pool_name",
    "read_metrics",
    "reinforce",
    "reuse_freed_memory",
    "save_policy",
    "servable_head_dim",
    "write_report",
]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_HOME[name]}"), name)
