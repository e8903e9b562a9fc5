"""GRPO-family policy losses, group advantages, KL estimators and importance correction.

Pure torch: turns a batch of scored rollouts into a policy update (Dr. GRPO by default).
"""

from importlib.metadata import version as _version

__version__ = _version("tandem-grpo")
