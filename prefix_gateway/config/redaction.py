"""Secrets as `prefix-gateway config` prints them, and the refusal of that placeholder when it
comes back as a setting: a configuration printed and read back must not run with
`<redacted>` as its admin token or a tenant's key."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from prefix_gateway.config.errors import ConfigError

if TYPE_CHECKING:
    from prefix_gateway.config.settings import Settings

REDACTED = "<redacted>"


def redacted(value: Any) -> Any:
    """`value` with every secret in it replaced; an unset secret stays as it is, so that
    whether it is set still shows."""
    if isinstance(value, tuple):
        return tuple(REDACTED for _ in value)
    return REDACTED if value else value


def without_password(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:{REDACTED}@{host}"))


def refuse_placeholder(where: str, value: str) -> None:
    if value == REDACTED:
        raise ConfigError(
            f"{where} is {REDACTED!r}, what `prefix-gateway config` prints in place of a secret:"
            " give the secret itself"
        )


def refuse_placeholders(settings: Settings) -> None:
    """`ConfigError` for the first secret setting whose value is the placeholder."""
    for f in dataclasses.fields(settings):
        if f.metadata.get("secret"):
            value = getattr(settings, f.name)
            for item in value if isinstance(value, tuple) else (value,):
                refuse_placeholder(f.name, item)
    refuse_placeholder("the password in redis_url", urlsplit(settings.redis_url).password or "")
