"""Batch-invariant ops, deterministic MoE routing and router replay.

Rollout engines and trainers must compute the same numbers for RL on Mixture-of-Experts
models: the same log-probs and the same expert choices for every token. This package holds
the ops, routing and replay machinery that make that hold.
"""

from importlib.metadata import version as _version

__version__ = _version("tandem-moe-determinism")
