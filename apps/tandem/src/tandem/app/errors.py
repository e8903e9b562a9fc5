"""Errors the command line reports to the user as one clear line, without a traceback."""


class ConfigError(ValueError):
    """A config file or override is invalid: the message names the key and the reason."""
