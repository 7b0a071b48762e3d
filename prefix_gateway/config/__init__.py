"""Settings, and reading them from flags, the environment and a YAML file."""

from prefix_gateway.config.settings import ConfigError, Settings
from prefix_gateway.config.sources import (
    _env_name,
    add_arguments,
    load_settings,
    unknown_variables,
)

__all__ = [
    "ConfigError",
    "Settings",
    "_env_name",
    "add_arguments",
    "load_settings",
    "unknown_variables",
]
