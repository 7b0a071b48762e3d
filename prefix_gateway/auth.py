"""Who may call what: client API keys on `/v1/...`, the admin token on `/admin/...`.

Compared in constant time against every key, so that neither timing nor position tells a
caller anything. Without a token the admin API is open on a loopback listener only, and only to
requests from this machine: its client (the one a `--trusted-proxies` proxy names, as for the
forwarding headers) and every address its forwarding headers name on loopback, addressed to a
loopback host and sent by no page of another origin. A reverse proxy on the same host would
otherwise hand the admin API to everyone it serves, and a browser on the machine would let any
web page post to it (a form, or DNS rebinding).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Iterable
from urllib.parse import urlsplit

from prefix_gateway.errors import Forbidden, Unauthorized
from prefix_gateway.refusals import refused

PROTECTED_PREFIX = "/v1/"
TENANT = "gateway.tenant"
"""The ASGI scope key of the request's cache namespace, under `--isolate-tenants`."""
KEY_POSITION = "gateway.key_position"
"""The ASGI scope key of where the request's key is among the client keys (its tenant)."""


def bearer(authorization: bytes | None) -> bytes | None:
    """The token of an `Authorization: Bearer <token>` header, if it is one."""
    if authorization is None:
        return None
    scheme, _, token = authorization.partition(b" ")
    token = token.strip()
    return token if scheme.lower() == b"bearer" and token else None


def tenant_of(key: bytes) -> str:
    """A tenant's name: a hash of its API key, so that the key itself is kept nowhere."""
    return hashlib.blake2b(key, digest_size=8, person=b"pgw-tenant").hexdigest()


class ApiKeys:
    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = [key.encode() for key in keys if key]

    def __bool__(self) -> bool:
        return bool(self._keys)

    def check(self, headers: list[tuple[bytes, bytes]]) -> tuple[bytes, int]:
        """The key the headers carry (`Authorization: Bearer`, else Anthropic's `x-api-key`)
        and its position among the keys; `Unauthorized` unless it is one of them."""
        authorization = api_key = None
        for name, value in headers:
            if name == b"authorization":
                authorization = value
                break
            if name == b"x-api-key" and api_key is None:
                api_key = value
        if authorization is None and api_key is None:
            raise Unauthorized(
                "You didn't provide an API key: send `Authorization: Bearer <key>` or"
                " `x-api-key: <key>`.",
                code="missing_api_key",
            )
        token = (bearer(authorization) or b"") if authorization is not None else api_key or b""
        position = -1
        for index, key in enumerate(self._keys):
            # Every key is compared, matched or not.
            if hmac.compare_digest(token, key):
                position = index
        if position < 0:
            raise Unauthorized("Incorrect API key provided.", code="invalid_api_key")
        return token, position


class AdminAccess:
    def __init__(self, token: str, listen_host: str) -> None:
        self._token = token.encode()
        self.open = not token and is_loopback(listen_host)
        """No token, and only this machine can reach the listener: anyone may."""
        self.disabled = not token and not self.open

    def check(
        self,
        authorization: bytes | None,
        host: str | None = None,
        origin: str | None = None,
        client: str | None = None,
        forwarded: Iterable[str] = (),
    ) -> None:
        """Refuse unless allowed; `host` and `origin` are the request's headers of those names,
        `client` the address of its client (a trusted proxy's word for it, else the peer's),
        `forwarded` its `X-Forwarded-For` and `Forwarded` headers."""
        if self.open:
            if client is not None and not is_loopback(client):
                raise refused("foreign_client", client)
            relayed_for = _forwarded_clients(forwarded)
            if relayed_for is not None:
                raise refused("foreign_client", relayed_for)
            if host is not None and not is_loopback(host_name(host)):
                raise refused("foreign_host", host)
            if origin is not None and not is_loopback(urlsplit(origin).hostname or ""):
                raise refused("foreign_origin", origin)
            return
        if self.disabled:
            raise Forbidden(
                "the admin API is off: the gateway listens beyond loopback and no admin token"
                " is set (--admin-token)",
                code="admin_disabled",
            )
        given = bearer(authorization)
        if given is None:
            raise Unauthorized(
                "this endpoint needs `Authorization: Bearer <admin token>`", code="missing_token"
            )
        if not hmac.compare_digest(given, self._token):
            raise Forbidden("the admin token is not valid", code="invalid_token")


def _forwarded_clients(headers: Iterable[str]) -> str | None:
    """The first address beyond loopback that forwarding headers name (`X-Forwarded-For`'s
    entries, `Forwarded`'s `for=`), if any: a proxy relayed the request for someone else."""
    for value in headers:
        for entry in value.split(","):
            for part in entry.split(";"):
                name, equals, given = part.strip().partition("=")
                address = given if equals else name
                if equals and name.strip().lower() != "for":
                    continue
                address = address.strip().strip('"')
                if address and not is_loopback(host_name(address)):
                    return address
    return None


def host_name(host: str) -> str:
    """The name or address of a `Host` header, without its port."""
    if host.startswith("["):
        return host[1:].partition("]")[0]
    if host.count(":") == 1:
        return host.partition(":")[0]
    return host


def is_loopback(host: str) -> bool:
    """Whether a listener on `host` is reachable from this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
