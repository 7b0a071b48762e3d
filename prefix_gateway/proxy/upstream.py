"""The upstream side of the request path: pooled keep-alive connections to the replicas, and
the one place where a failure there becomes the client's error (its code in
`prefix_gateway/refusals.py`'s table).

The request path uses the gateway's own HTTP/1.1 client (`http1.py`); httpx stays for probes.
Only the connect timeout is the client's: the wait for the first byte, the gaps inside a
response and the whole request's time are the proxy's deadlines (`deadlines.py`).

Client credentials stop here: the `Authorization` header a replica sees is the gateway's own
(`--upstream-api-key`), and no `x-api-key` reaches it, unless the operator asks to pass the
client's on.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable, Iterable

from prefix_gateway.errors import GatewayError
from prefix_gateway.proxy.deadlines import Why, client_error
from prefix_gateway.proxy.http1 import ConnectionPool, HTTPClientError, Response
from prefix_gateway.refusals import refused

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
        b"proxy-connection",
        b"host",
        b"content-length",
        # The gateway has read the whole body before it forwards a request: a client's
        # `Expect: 100-continue` would only make the replica wait for nothing.
        b"expect",
    }
)
CREDENTIALS = frozenset({b"authorization", b"x-api-key"})
"""A client's key, as OpenAI's clients send it and as Anthropic's do."""
_VIA = b"1.1 prefix-gateway"
_OWN = (b"x-request-id", b"x-forwarded-for", b"x-forwarded-proto", b"via")


class UpstreamError(Exception):
    """A failed attempt at a replica: the cause (a metric label) and the client's error."""

    def __init__(self, cause: str, error: GatewayError) -> None:
        super().__init__(error.message)
        self.cause = cause
        self.error = error


_FAILURES = {
    "connect": "upstream_unreachable",
    "protocol": "upstream_failed",
    "timeout": "first_byte_timeout",
    "stream_broken": "stream_broken",
    "stream_idle": "stream_idle_timeout",
    "request_timeout": "request_timeout",
    "stalled": "upstream_stalled",
    "malformed": "upstream_failed",
}
"""Each cause of a failed attempt (the `upstream_errors` label) and its refusal's code."""
_CAUSES = {"connect": "connect", "connect_timeout": "connect"}
_INTERRUPTIONS = {
    Why.FIRST_BYTE: "timeout",
    Why.IDLE: "stream_idle",
    Why.TOTAL: "request_timeout",
    Why.STALLED: "stalled",
}


def failure(cause: str, seconds: float = 0.0) -> UpstreamError:
    """The failure of an attempt for `cause`; `seconds`: the limit that ran out, if one did."""
    return UpstreamError(cause, refused(_FAILURES[cause], seconds))


def interrupted(why: Why, seconds: float = 0.0) -> UpstreamError | None:
    """The failure of an attempt interrupted for `why`, or None when that is not the attempt's
    failure (the client went away)."""
    cause = _INTERRUPTIONS.get(why)
    error = client_error(why, seconds)
    return None if cause is None or error is None else UpstreamError(cause, error)


def failure_of(exc: HTTPClientError) -> UpstreamError:
    """The failure of an attempt whose connection or response failed with `exc`."""
    return failure(_CAUSES.get(exc.cause, "protocol"))


ENGINE_PRIORITY_HEADER = b"x-vllm-priority"
"""Read by vLLM before the body's `priority` (chat, completions, responses)."""
DATA_PARALLEL_RANK_HEADER = b"x-data-parallel-rank"
"""vLLM's choice of the data-parallel engine a request runs on."""


def engine_headers_dropped(allowed: Iterable[str], forward_priority: bool) -> frozenset[bytes]:
    """The engine-control headers a client may not send, given what `--engine-control`
    allows: its priority (never under `--forward-priority`, which sets the tenant's) and its
    data-parallel rank."""
    allowed = set(allowed)
    dropped = set()
    if "priority" not in allowed or forward_priority:
        dropped.add(ENGINE_PRIORITY_HEADER)
    if "data_parallel_rank" not in allowed:
        dropped.add(DATA_PARALLEL_RANK_HEADER)
    return frozenset(dropped)


class Upstream:
    def __init__(
        self,
        connect_timeout: float,
        upstream_api_key: str = "",
        forward_client_auth: bool = False,
        *,
        tls: ssl.SSLContext | None = None,
        on_resend: Callable[[str], None] | None = None,
        engine_headers: frozenset[bytes] = frozenset(),
    ) -> None:
        """`tls`: how replicas' certificates are checked; `on_resend(reason)`: told of each
        request the pool sent again on a new connection; `engine_headers`: the engine-control
        headers of clients that are dropped (`engine_headers_dropped`)."""
        self._connect_timeout = connect_timeout
        self._tls = tls
        self._on_resend = on_resend
        self._dropped = (HOP_BY_HOP if forward_client_auth else HOP_BY_HOP | CREDENTIALS) | (
            engine_headers
        )
        self._added: list[tuple[bytes, bytes]] = []
        if upstream_api_key:
            self._added.append((b"authorization", f"Bearer {upstream_api_key}".encode()))
        self._pool: ConnectionPool | None = None

    async def start(self) -> None:
        self._pool = ConnectionPool(self._connect_timeout, tls=self._tls, on_resend=self._on_resend)

    async def close(self) -> None:
        if self._pool is not None:
            self._pool.close()

    def headers_for(
        self,
        headers: Iterable[tuple[bytes, bytes]],
        request_id: bytes,
        peer: str | None,
        scheme: str,
    ) -> list[tuple[bytes, bytes]]:
        """The client's headers as a replica gets them: hop-by-hop ones dropped (RFC 9110
        7.6.1, with any the Connection header names), the client's credentials unless told
        to pass them, and the gateway's own added: the request id, `Via` (which stops a
        request from looping back through the gateway), `X-Forwarded-For` with the address of
        the connection's other end appended (a proxy's, behind one: the chain keeps every hop)
        and `X-Forwarded-Proto` as the gateway takes it (a client's own claim only from a
        trusted proxy, `--trusted-proxies`)."""
        dropped = self._dropped
        forwarded: list[tuple[bytes, bytes]] = []
        forwarded_for = via = b""
        named: set[bytes] = set()
        for name, value in headers:
            if name in dropped:
                if name == b"connection" or name == b"proxy-connection":
                    named.update(token.strip().lower() for token in value.split(b","))
            elif name in _OWN:
                if name == b"x-forwarded-for":
                    forwarded_for = value + b", "
                elif name == b"via":
                    via = value + b", "
            else:
                forwarded.append((name, value))
        if named:
            forwarded = [item for item in forwarded if item[0] not in named]
        forwarded.append((b"x-request-id", request_id))
        forwarded.append((b"via", via + _VIA))
        if peer:
            forwarded.append((b"x-forwarded-for", forwarded_for + peer.encode()))
        forwarded.append((b"x-forwarded-proto", scheme.encode()))
        return forwarded

    async def send(
        self,
        url: str,
        body: bytes,
        headers: list[tuple[bytes, bytes]],
        credentials: bool,
        method: bytes = b"POST",
    ) -> Response:
        """POST `body` unchanged (or send it with `method`) and return once the response
        headers have arrived; `credentials`: the replica is one the operator configured or
        discovery found, and gets the gateway's upstream key."""
        assert self._pool is not None, "Upstream.start() was not awaited"
        if credentials and self._added:
            headers = headers + self._added
        try:
            return await self._pool.post(url, headers, body, method)
        except HTTPClientError as exc:
            raise failure_of(exc) from exc


def passed_through(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """Whether a request already went through a prefix gateway (its `Via` says so)."""
    for name, value in headers:  # noqa: SIM110 (a generator costs a call per header)
        if name == b"via" and b"prefix-gateway" in value:
            return True
    return False


_NOT_RELAYED = HOP_BY_HOP | {b"set-cookie"}
"""A replica's cookies are not the client's business: one with a `Domain` would reach every
host of that domain through the gateway's name (docs/endpoints.md)."""


def response_headers(raw: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    relayed = []
    for name, value in raw:
        lowered = name.lower()
        if lowered not in _NOT_RELAYED:
            relayed.append((lowered, value))
    return relayed
