"""The upstream HTTP client: pooled keep-alive connections to the replicas.

aiohttp is used on the request path because it costs a third of httpx's CPU per proxied
request here (see docs/benchmarks.md); httpx stays for probes. Low-level errors are mapped in
one place to the gateway's own, each with a short cause used as a metric label.
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


class Upstream:
    def __init__(self, connect_timeout: float, first_byte_timeout: float) -> None:
        self._timeout = aiohttp.ClientTimeout(
            total=None,
            connect=connect_timeout,
            sock_connect=connect_timeout,
            sock_read=first_byte_timeout,
        )
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
        forwarded = [
            (name.decode("latin-1"), value.decode("latin-1"))
            for name, value in headers
            if name not in HOP_BY_HOP
        ]
        try:
            return await self._session.post(url, data=body, headers=forwarded)
        except TimeoutError as exc:
            raise UpstreamError("timeout", UpstreamTimeout("upstream timed out")) from exc
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamError(
                "connect", UpstreamFailed(f"cannot connect to upstream: {exc.strerror}")
            ) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamError(
                "protocol", UpstreamFailed(f"upstream failed: {type(exc).__name__}")
            ) from exc


def response_headers(raw: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(name.lower(), value) for name, value in raw if name.lower() not in HOP_BY_HOP]
