"""Secrets as `prefix-gateway config` prints them, and the refusal of that placeholder when it
comes back as a setting: a configuration printed and read back must not run with
`<redacted>` as its admin token or a tenant's key."""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from prefix_gateway.config.errors import ConfigError

if TYPE_CHECKING:
    from prefix_gateway.config.settings import Settings

REDACTED = "<redacted>"
_SECRET = re.compile(r"token|passw|secret|key|auth|sig|credential", re.IGNORECASE)


def redacted(value: Any) -> Any:
    """`value` with every secret in it replaced; an unset secret stays as it is, so that
    whether it is set still shows."""
    if isinstance(value, tuple):
        return tuple(REDACTED for _ in value)
    return REDACTED if value else value


def without_password(url: str) -> str:
    """`url` (or a `MODEL=URL` spec) with the credentials it carries redacted: a password
    (the user name kept), a user name alone (a token given so), and query values whose name
    says secret (`token`, `password`, `key`...). Anything else comes back as it is."""
    if "://" not in url:
        return url
    model, equals, rest = url.partition("=")
    if equals and "://" in rest and "://" not in model:
        return f"{model}={without_password(rest)}"
    try:
        parts = urlsplit(url)
        password, user = parts.password, parts.username
    except ValueError:
        return url
    if "@" in parts.netloc:
        host = parts.netloc.rsplit("@", 1)[1]
        userinfo = f"{user or ''}:{REDACTED}" if password is not None else REDACTED
        parts = parts._replace(netloc=f"{userinfo}@{host}")
    if parts.query:
        pairs = [pair.partition("=") for pair in parts.query.split("&")]
        parts = parts._replace(
            query="&".join(
                f"{name}{equals}{REDACTED if equals and _SECRET.search(name) else value}"
                for name, equals, value in pairs
            )
        )
    return urlunsplit(parts)


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
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        for item in value if isinstance(value, tuple) else (value,):
            if isinstance(item, str) and "://" in item and REDACTED in item:
                refuse_placeholder(f"the credentials in {f.name}", REDACTED)
