"""The one error type of configuration problems."""


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the key path."""
