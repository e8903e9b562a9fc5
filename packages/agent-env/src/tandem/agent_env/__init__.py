"""Sandboxed multi-turn software-engineering environments.

An agent edits a repository snapshot through tools, in a sandbox with no network and strict
limits; the reward comes from hidden tests. No torch needed.
"""

from importlib.metadata import version as _version

__version__ = _version("tandem-agent-env")
