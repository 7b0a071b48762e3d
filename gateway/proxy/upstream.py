"""The upstream HTTP client: pooled keep-alive connections to the replicas.

The request path uses the gateway's own HTTP/1.1 client (`gateway.proxy.http1`): it costs about half
of aiohttp's CPU per proxied request here, and aiohttp a third of httpx's (see
docs/benchmarks.md); httpx stays for probes. Low-level errors are mapped in one place
(`upstream_error`) to the gateway's own, each with a short cause used as a metric label. Only
the connect timeout is the client's: the wait for the first byte, the idle gap inside a
response and the whole request's time are watched by the proxy (`DeadlineWatch`),
which costs no timer per chunk.

Client credentials stop here: the `Authorization` header a replica sees is the gateway's own
(`--upstream-api-key`), unless the operator asks to pass the client's on.
"""

from __future__ import annotations

from collections.abc import Iterable

from gateway.errors import GatewayError, UpstreamFailed, UpstreamTimeout
from gateway.proxy.http1 import ConnectionPool, HTTPClientError, Response

UpstreamResponse = Response

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
        # The gateway has read the whole body before it forwards a request: passed on, a
        # client's `Expect: 100-continue` made the replica answer `100 Continue` first, which
        # the request path would take for the response.
        b"expect",
    }
)


class UpstreamError(Exception):
    """A failure talking to a replica, with the cause used in metrics."""

    def __init__(self, cause: str, error: GatewayError) -> None:
        super().__init__(error.message)
        self.cause = cause
        self.error = error


_CAUSES = {
    "connect": "connect",
    "connect_timeout": "connect",
    "closed": "protocol",
    "protocol": "protocol",
    "config": "protocol",
}


def upstream_error(exc: BaseException) -> UpstreamError:
    """The gateway's view of an exception raised while sending to or reading from a replica."""
    if isinstance(exc, HTTPClientError):
        if exc.cause in ("first_byte_timeout", "idle_timeout"):
            return UpstreamError("timeout", UpstreamTimeout("upstream timed out"))
        cause = _CAUSES.get(exc.cause, "protocol")
        if cause == "connect":
            return UpstreamError("connect", UpstreamFailed(str(exc)))
        return UpstreamError("protocol", UpstreamFailed(f"upstream failed: {exc}"))
    if isinstance(exc, TimeoutError):
        return UpstreamError("timeout", UpstreamTimeout("upstream timed out"))
    return UpstreamError("protocol", UpstreamFailed(f"upstream failed: {type(exc).__name__}"))


UPSTREAM_EXCEPTIONS = (HTTPClientError, OSError, TimeoutError)
"""What a send or a read may raise that `upstream_error` maps."""


class Upstream:
    def __init__(
        self,
        connect_timeout: float,
        upstream_api_key: str = "",
        forward_client_auth: bool = False,
    ) -> None:
        self._connect_timeout = connect_timeout
        self._dropped = HOP_BY_HOP if forward_client_auth else HOP_BY_HOP | {b"authorization"}
        self._added: list[tuple[bytes, bytes]] = []
        if upstream_api_key:
            self._added.append((b"authorization", f"Bearer {upstream_api_key}".encode()))
        self._pool: ConnectionPool | None = None

    async def start(self) -> None:
        self._pool = ConnectionPool(self._connect_timeout)

    async def close(self) -> None:
        if self._pool is not None:
            self._pool.close()

    async def send(
        self, url: str, body: bytes, headers: Iterable[tuple[bytes, bytes]]
    ) -> UpstreamResponse:
        """POST `body` unchanged and return once the response headers have arrived."""
        assert self._pool is not None, "Upstream.start() was not awaited"
        dropped = self._dropped
        forwarded = [(name, value) for name, value in headers if name not in dropped]
        if self._added:
            forwarded.extend(self._added)
        try:
            return await self._pool.post(url, forwarded, body)
        except UPSTREAM_EXCEPTIONS as exc:
            raise upstream_error(exc) from exc


def response_headers(raw: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(name.lower(), value) for name, value in raw if name.lower() not in HOP_BY_HOP]
