"""The asynchronous RL pipeline.

Rollout workers, a staleness-bounded buffer, the trainer loop, weight publication and
pulling, checkpoint/resume and metrics, wiring the other tandem packages together.
"""

from importlib.metadata import version as _version

__version__ = _version("tandem-orchestrator")
