"""A lean HTTP/1.1 client for the request path: pooled keep-alive connections to replicas.

Each request is one socket write (head and body together); the response is parsed as it
arrives and its body handed on chunk by chunk (`http1_connection.py`). It does only what the
proxy needs — POST a body, read a response, keep the connection for the next request — at a
fraction of a general client's CPU per request (see docs/benchmarks.md).

A request is sent again, once, on a new connection only when the replica cannot have read it:
it went out on a reused connection that the replica closed before any byte of the response,
and either the write itself failed or the replica's host had not acknowledged all of it (TCP's
own count, read on Linux for plain connections). A kept-alive connection that sent anything or
closed while idle is dropped when taken, before a request is written on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

from prefix_gateway.proxy.http1_connection import (
    Connection,
    Headers,
    HTTPClientError,
    Origin,
    Response,
)

__all__ = ["ConnectionPool", "HTTPClientError", "Headers", "Origin", "Response", "client_tls"]


def client_tls(ca_file: str = "", verify: bool = True) -> ssl.SSLContext:
    """How replicas' certificates are checked: against `ca_file` (PEM), or the system's CAs;
    not at all without `verify`."""
    context = ssl.create_default_context(cafile=ca_file or None)
    if not verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


_MAX_HEADS = 4096


class ConnectionPool:
    """Idle keep-alive connections per (host, port), reused most recent first."""

    def __init__(
        self,
        connect_timeout: float,
        max_idle_per_host: int = 256,
        *,
        tls: ssl.SSLContext | None = None,
        on_resend: Callable[[str], None] | None = None,
        max_head_bytes: int = 64 * 1024,
        max_headers: int = 100,
    ) -> None:
        """`tls`: for https:// origins (default: `client_tls()`); `on_resend(reason)`: told of
        each request sent again; `max_head_bytes`, `max_headers`: a response head's limits."""
        self._connect_timeout = connect_timeout
        self._max_idle = max_idle_per_host
        self._idle: dict[Origin, list[Connection]] = {}
        self._heads: dict[tuple[bytes, str], tuple[Origin, bytes]] = {}
        self._tls = tls
        self._on_resend = on_resend
        self._max_head_bytes = max_head_bytes
        self._max_headers = max_headers

    async def post(
        self,
        url: str,
        headers: Iterable[tuple[bytes, bytes]],
        body: bytes,
        method: bytes = b"POST",
    ) -> Response:
        """POST `body` to `url` (or send it with `method`); returns once the response's status
        and headers are in (the caller bounds the wait)."""
        key, head = self._origin(method, url)
        parts = [head, b"content-length: ", str(len(body)).encode(), b"\r\n"]
        for name, value in headers:
            parts += (name, b": ", value, b"\r\n")
        parts += (b"\r\n", body)
        request = b"".join(parts)
        resend = None
        connection = self._take(key)
        if connection is not None:
            try:
                return await self._exchange(connection, request)
            except HTTPClientError:
                resend = connection.resend
                if resend is None:
                    raise
        connection = await self._connect(key)
        if resend is not None and self._on_resend is not None:
            self._on_resend(resend)
        return await self._exchange(connection, request)

    def put_back(self, connection: Connection) -> None:
        idle = self._idle.setdefault(connection.key, [])
        if len(idle) < self._max_idle:
            idle.append(connection)
            connection.idle = True
        else:
            connection.close()

    def forget(self, connection: Connection) -> None:
        """Drop an idle connection that closed or spoke out of turn."""
        with contextlib.suppress(KeyError, ValueError):
            self._idle[connection.key].remove(connection)

    def close(self) -> None:
        every, self._idle = self._idle, {}
        for idle in every.values():
            for connection in idle:
                connection.idle = False
                connection.close()

    def _origin(self, method: bytes, url: str) -> tuple[Origin, bytes]:
        cached = self._heads.get((method, url))
        if cached is None:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise HTTPClientError("config", f"unsupported upstream URL {url!r}")
            tls = parts.scheme == "https"
            port = parts.port or (443 if tls else 80)
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            head = method + f" {path} HTTP/1.1\r\nhost: {parts.netloc}\r\n".encode()
            if len(self._heads) >= _MAX_HEADS:
                self._heads.clear()  # paths naming a response each come once
            cached = self._heads[(method, url)] = ((parts.hostname, port, tls), head)
        return cached

    def _take(self, key: Origin) -> Connection | None:
        idle = self._idle.get(key)
        while idle:
            connection = idle.pop()
            connection.idle = False
            if connection.usable():
                return connection
            connection.close()
        return None

    async def _connect(self, key: Origin) -> Connection:
        loop = asyncio.get_running_loop()
        host, port, tls = key
        context = None
        if tls:
            context = self._tls = self._tls or client_tls()
        try:
            async with asyncio.timeout(self._connect_timeout):
                transport, protocol = await loop.create_connection(
                    lambda: Connection(self, key, self._max_head_bytes, self._max_headers),
                    host,
                    port,
                    ssl=context,
                )
        except TimeoutError as exc:
            raise HTTPClientError("connect_timeout", f"connecting to {key} timed out") from exc
        except OSError as exc:
            reason = exc.strerror or exc
            raise HTTPClientError("connect", f"cannot connect to {key}: {reason}") from exc
        # uvloop may deliver connection_made after create_connection has returned.
        protocol.connection_made(transport)
        return protocol

    async def _exchange(self, connection: Connection, request: bytes) -> Response:
        response = connection.send(request)
        try:
            await response.started
        except BaseException:
            # Failed, or cancelled (a client that left, a deadline): the replica must see the
            # connection close, so that it stops working on the request.
            connection.close()
            raise
        return response
