"""The one error of configuration."""


class ConfigError(ValueError):
    """A setting that cannot be used; raised at start-up, never while serving."""
