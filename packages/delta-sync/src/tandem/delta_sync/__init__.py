"""Bit-exact compressed weight deltas, published and pulled through object stores.

After every RL step the trainer publishes only what changed since the previous version;
inference engines anywhere pull, verify and apply it with a short pause. No torch needed.
"""

from importlib.metadata import version as _version

__version__ = _version("tandem-delta-sync")
