"""A lean HTTP/1.1 client for the request path: pooled keep-alive connections to replicas.

Each request is one socket write (head and body together); the response is parsed by
httptools as it arrives and its body handed on chunk by chunk, with no buffering beyond what
the reader has not taken yet (reading pauses past a high-water mark). It does only what the
proxy needs — POST a body, read a response, keep the connection for the next request — at a
fraction of a general client's CPU per request (see docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Iterable
from typing import cast
from urllib.parse import urlsplit

import httptools

_HIGH_WATER = 1 << 20

Origin = tuple[str, int, bool]
"""Host, port, and whether the connection uses TLS."""


class HTTPClientError(Exception):
    """A request that failed; `cause` is a short label for metrics."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause


class Headers:
    """Case-insensitive look-up over a response's raw header list."""

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self._raw = raw

    def get(self, name: str, default: str | None = None) -> str | None:
        wanted = name.lower().encode("latin-1")
        for key, value in self._raw:
            if key.lower() == wanted:
                return value.decode("latin-1")
        return default


class Response:
    def __init__(self, connection: _Connection) -> None:
        self._connection = connection
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = False
        self.started = connection.loop.create_future()
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self.complete = False
        self._error: HTTPClientError | None = None

    @property
    def headers(self) -> Headers:
        return Headers(self.raw_headers)

    @property
    def content(self) -> Response:
        """The body as a stream (`readany`), as aiohttp's responses offer it."""
        return self

    async def read(self) -> bytes:
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def readany(self) -> bytes:
        """The next chunk of the body as soon as there is one; b"" once it has ended."""
        while True:
            if self._chunks:
                chunk = self._chunks.popleft()
                self._buffered -= len(chunk)
                if self._buffered < _HIGH_WATER:
                    self._connection.resume()
                return chunk
            if self._error is not None:
                raise self._error
            if self.complete:
                return b""
            self._waiter = self._connection.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def release(self) -> None:
        """Give the connection back for reuse, or close it if the response is not finished."""
        self._connection.finish(self)

    # Called by the connection.
    def feed(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._buffered += len(chunk)
        if self._buffered >= _HIGH_WATER:
            self._connection.pause()
        self._wake()

    def end(self) -> None:
        self.complete = True
        self._wake()

    def fail(self, error: HTTPClientError) -> None:
        if self.complete:
            return
        self._error = error
        if not self.started.done():
            self.started.set_exception(error)
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class _Connection(asyncio.Protocol):
    def __init__(self, pool: ConnectionPool, key: Origin) -> None:
        self.pool = pool
        self.key = key
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.closed = False
        self._paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not subclasses of asyncio.Transport, but behave as one.
        self.transport = cast(asyncio.Transport, transport)

    def send(self, data: bytes) -> Response:
        assert self.transport is not None
        self.response = Response(self)
        self.transport.write(data)
        return self.response

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self.response is not None:
                self.response.fail(HTTPClientError("protocol", f"bad upstream response: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.response is not None and not self.response.complete:
            self.response.fail(HTTPClientError("closed", "upstream closed the connection"))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if self.response is not None:
            self.response.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        response = self.response
        if response is not None:
            response.status = self.parser.get_status_code()
            response.keep_alive = self.parser.should_keep_alive()
            if not response.started.done():
                response.started.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response.feed(body)

    def on_message_complete(self) -> None:
        if self.response is not None:
            self.response.end()

    # Flow control and lifetime
    def pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()

    def finish(self, response: Response) -> None:
        if response is not self.response:
            return
        self.response = None
        if response.complete and response.keep_alive and not self.closed:
            self.resume()
            self.pool.put_back(self)
        else:
            self.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class ConnectionPool:
    """Idle keep-alive connections per (host, port), reused most recent first."""

    def __init__(self, connect_timeout: float, max_idle_per_host: int = 256) -> None:
        self._connect_timeout = connect_timeout
        self._max_idle = max_idle_per_host
        self._idle: dict[Origin, list[_Connection]] = {}
        self._heads: dict[str, tuple[Origin, bytes]] = {}
        self._tls: ssl.SSLContext | None = None

    async def post(
        self,
        url: str,
        headers: Iterable[tuple[bytes, bytes]],
        body: bytes,
    ) -> Response:
        """POST `body` to `url`; returns once the response's status and headers are in (the
        caller bounds the wait)."""
        key, head = self._origin(url)
        request = b"".join(
            [
                head,
                b"content-length: ",
                str(len(body)).encode(),
                b"\r\n",
                *(name + b": " + value + b"\r\n" for name, value in headers),
                b"\r\n",
                body,
            ]
        )
        connection = self._take(key)
        if connection is not None:
            try:
                return await self._exchange(connection, request)
            except HTTPClientError as error:
                # A kept-alive connection the replica closed meanwhile: once more on a new one.
                if error.cause != "closed":
                    raise
        connection = await self._connect(key)
        return await self._exchange(connection, request)

    def put_back(self, connection: _Connection) -> None:
        idle = self._idle.setdefault(connection.key, [])
        if len(idle) < self._max_idle:
            idle.append(connection)
        else:
            connection.close()

    def close(self) -> None:
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
        self._idle.clear()

    def _origin(self, url: str) -> tuple[Origin, bytes]:
        cached = self._heads.get(url)
        if cached is None:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise HTTPClientError("config", f"unsupported upstream URL {url!r}")
            tls = parts.scheme == "https"
            port = parts.port or (443 if tls else 80)
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            head = f"POST {path} HTTP/1.1\r\nhost: {parts.netloc}\r\n".encode()
            cached = self._heads[url] = ((parts.hostname, port, tls), head)
        return cached

    def _take(self, key: Origin) -> _Connection | None:
        idle = self._idle.get(key)
        while idle:
            connection = idle.pop()
            if not connection.closed:
                return connection
        return None

    async def _connect(self, key: Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        host, port, tls = key
        context = None
        if tls:
            context = self._tls = self._tls or ssl.create_default_context()
        try:
            async with asyncio.timeout(self._connect_timeout):
                transport, protocol = await loop.create_connection(
                    lambda: _Connection(self, key), host, port, ssl=context
                )
        except TimeoutError as exc:
            raise HTTPClientError("connect_timeout", f"connecting to {key} timed out") from exc
        except OSError as exc:
            raise HTTPClientError("connect", f"cannot connect to {key}: {exc.strerror}") from exc
        # uvloop may deliver connection_made after create_connection has returned.
        protocol.connection_made(transport)
        return protocol

    async def _exchange(self, connection: _Connection, request: bytes) -> Response:
        response = connection.send(request)
        try:
            await response.started
        except BaseException:
            # Failed, or cancelled (a client that left, a deadline): the replica must see the
            # connection close, so that it stops working on the request.
            connection.close()
            raise
        return response
