"""The upstream HTTP client: pooled keep-alive connections to the replicas.

aiohttp is used on the request path because it costs a third of httpx's CPU per proxied
request here (see docs/benchmarks.md); httpx stays for probes. Low-level errors are mapped in
one place (`upstream_error`) to the gateway's own, each with a short cause used as a metric
label. Only the connect timeout is aiohttp's: the wait for the first byte, the idle gap inside a
response and the whole request's time are watched by the proxy (`gateway.proxy.DeadlineWatch`),
which costs no timer per chunk.

Client credentials stop here: the `Authorization` header a replica sees is the gateway's own
(`--upstream-api-key`), unless the operator asks to pass the client's on.
"""

from __future__ import annotations

from collections.abc import Iterable

import aiohttp

from gateway.errors import GatewayError, UpstreamFailed, UpstreamTimeout

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
    }
)


class UpstreamError(Exception):
    """A failure talking to a replica, with the cause used in metrics."""

    def __init__(self, cause: str, error: GatewayError) -> None:
        super().__init__(error.message)
        self.cause = cause
        self.error = error


def upstream_error(exc: BaseException) -> UpstreamError:
    """The gateway's view of an exception raised while sending to or reading from a replica."""
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return UpstreamError("connect", UpstreamFailed("timed out connecting to upstream"))
    if isinstance(exc, aiohttp.ClientConnectorError):
        return UpstreamError(
            "connect", UpstreamFailed(f"cannot connect to upstream: {exc.strerror}")
        )
    if isinstance(exc, TimeoutError):
        return UpstreamError("timeout", UpstreamTimeout("upstream timed out"))
    return UpstreamError("protocol", UpstreamFailed(f"upstream failed: {type(exc).__name__}"))


UPSTREAM_EXCEPTIONS = (aiohttp.ClientError, OSError, TimeoutError)
"""What a send or a read may raise that `upstream_error` maps (OSError covers the timeouts)."""


class Upstream:
    def __init__(
        self,
        connect_timeout: float,
        upstream_api_key: str = "",
        forward_client_auth: bool = False,
    ) -> None:
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=connect_timeout, sock_connect=connect_timeout, sock_read=None
        )
        self._dropped = HOP_BY_HOP if forward_client_auth else HOP_BY_HOP | {b"authorization"}
        self._added: list[tuple[str, str]] = []
        if upstream_api_key:
            self._added.append(("Authorization", f"Bearer {upstream_api_key}"))
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=60, keepalive_timeout=60)
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=self._timeout,
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
            cookie_jar=aiohttp.DummyCookieJar(),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def send(
        self, url: str, body: bytes, headers: Iterable[tuple[bytes, bytes]]
    ) -> aiohttp.ClientResponse:
        """POST `body` unchanged and return once the response headers have arrived."""
        assert self._session is not None, "Upstream.start() was not awaited"
        dropped = self._dropped
        forwarded = [
            (name.decode("latin-1"), value.decode("latin-1"))
            for name, value in headers
            if name not in dropped
        ]
        if self._added:
            forwarded.extend(self._added)
        try:
            return await self._session.post(url, data=body, headers=forwarded)
        except UPSTREAM_EXCEPTIONS as exc:
            raise upstream_error(exc) from exc


def response_headers(raw: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(name.lower(), value) for name, value in raw if name.lower() not in HOP_BY_HOP]
