"""The effective configuration: every setting after flags, variables, the file and defaults
were applied, with secrets redacted, as YAML that `--config` reads back (secrets aside)."""

from __future__ import annotations

import dataclasses
from typing import Any

import yaml

from prefix_gateway.config.redaction import REDACTED, redacted, without_password
from prefix_gateway.config.settings import Settings
from prefix_gateway.config.tenants import TenantSpec

__all__ = ["REDACTED", "as_yaml", "effective"]


def effective(settings: Settings) -> dict[str, Any]:
    """Each setting by name, in the order of `Settings`; a secret that is set reads
    `<redacted>`, so that whether it is set still shows."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(Settings):
        value = getattr(settings, f.name)
        if f.metadata.get("secret"):
            value = redacted(value)
        elif f.name == "tenants":
            value = [_tenant(tenant) for tenant in value]
        elif isinstance(value, str):
            value = without_password(value)  # a URL's credentials: Redis's, the API server's
        elif isinstance(value, tuple) and value and isinstance(value[0], str):
            value = tuple(without_password(item) for item in value)  # backends' URLs
        elif isinstance(value, tuple) and value and dataclasses.is_dataclass(value[0]):
            value = [dataclasses.asdict(entry) for entry in value]  # lora_adapters and the like
        values[f.name] = list(value) if isinstance(value, tuple) else value
    return values


def as_yaml(settings: Settings) -> str:
    return yaml.safe_dump(effective(settings), sort_keys=False, default_flow_style=False)


def _tenant(tenant: TenantSpec) -> dict[str, Any]:
    """A tenant as the file gives it: the variable its key is read from, else the key
    redacted (which the file refuses, rather than take it as the key)."""
    entry = dataclasses.asdict(tenant)
    if tenant.priority_range is not None:
        entry["priority_range"] = list(tenant.priority_range)
    if tenant.models is not None:
        entry["models"] = sorted(tenant.models)
    if tenant.api_key_env:
        del entry["api_key"]
    else:
        entry["api_key"] = REDACTED
        del entry["api_key_env"]
    return entry
