"""The error a bad configuration value raises, wherever it is read (flags, settings, layouts)."""


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the value."""
