"""The tandem command line: config loading, logging setup and subcommands.

This is the only place in tandem that configures logging or reads config files; the
libraries under ``packages/`` stay free of global side effects.
"""

from importlib.metadata import version as _version

__version__ = _version("tandem-rl")
