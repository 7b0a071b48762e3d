"""The effective configuration: every setting after flags, variables, the file and defaults
were applied, with secrets redacted, as YAML that `--config` reads back (secrets aside)."""

from __future__ import annotations

import dataclasses
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import yaml

from prefix_gateway.config.settings import Settings

REDACTED = "<redacted>"


def effective(settings: Settings) -> dict[str, Any]:
    """Each setting by name, in the order of `Settings`; a secret that is set reads
    `<redacted>`, so that whether it is set still shows."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(Settings):
        value = getattr(settings, f.name)
        if f.metadata.get("secret"):
            value = _redacted(value)
        elif f.name == "tenants":
            value = [{**dataclasses.asdict(tenant), "api_key": REDACTED} for tenant in value]
        elif f.name == "redis_url":
            value = _without_password(value)
        elif isinstance(value, tuple) and value and dataclasses.is_dataclass(value[0]):
            value = [dataclasses.asdict(entry) for entry in value]  # lora_adapters and the like
        values[f.name] = list(value) if isinstance(value, tuple) else value
    return values


def as_yaml(settings: Settings) -> str:
    return yaml.safe_dump(effective(settings), sort_keys=False, default_flow_style=False)


def _redacted(value: Any) -> Any:
    if isinstance(value, tuple):
        return tuple(REDACTED for _ in value)
    return REDACTED if value else value


def _without_password(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:{REDACTED}@{host}"))
