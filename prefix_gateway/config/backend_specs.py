"""A replica given as `URL` or `MODEL=URL`, read and checked: at start-up for `--backend`, and
for each replica added while serving (the admin API, discovery)."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from prefix_gateway.config.errors import ConfigError


@dataclass(frozen=True)
class BackendSpec:
    name: str
    """`HOST:PORT` as given: the replica's name in logs, metrics and the admin API."""
    url: str
    """The base URL requests are sent under, without a trailing `/v1`."""
    model: str | None
    """The one model it serves when given as `MODEL=URL`."""


def read_backend_spec(spec: str) -> BackendSpec:
    """`spec` as `http(s)://HOST[:PORT]` or `HOST:PORT`, optionally after `MODEL=`: a host, no
    credentials, query or fragment. `ConfigError` says what is wrong in one line."""
    if any(char.isspace() or not char.isprintable() for char in spec.strip()):
        raise ConfigError(f"backend {spec!r} holds whitespace or control characters")
    model: str | None = None
    url = spec.strip()
    if "=" in url and not url.split("=", 1)[0].startswith(("http://", "https://")):
        model, url = (part.strip() for part in url.split("=", 1))
    expected = "give http://HOST:PORT, https://HOST:PORT or HOST:PORT"
    if "://" not in url:
        # Without a scheme only HOST:PORT: a bare word is more likely a mistake than port 80.
        if ":" not in url.rsplit("]", 1)[-1]:
            raise ConfigError(f"backend {spec!r} is not a URL: {expected}")
        url = "http://" + url
    try:
        parts = urlsplit(url)
        hostname = parts.hostname
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError as exc:  # e.g. an unbalanced IPv6 bracket, a port out of range
        raise ConfigError(f"backend {spec!r} is not an http(s) URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not hostname:
        raise ConfigError(f"backend {spec!r} is not an http(s) URL: {expected}")
    if "@" in parts.netloc:
        raise ConfigError(f"backend {spec!r} carries credentials: use --upstream-api-key")
    if parts.query or parts.fragment:
        raise ConfigError(f"backend {spec!r} has a query or fragment")
    base = url.rstrip("/")
    if base.endswith("/v1"):
        base = base[: -len("/v1")]
    return BackendSpec(parts.netloc, base, model)
