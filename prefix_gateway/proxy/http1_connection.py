"""One kept-alive HTTP/1.1 connection to a replica, and the response read from it.

httptools parses each response as it arrives and its body is handed on chunk by chunk, with no
buffering beyond what the reader has not taken yet (reading pauses past a high-water mark).
Interim (1xx) responses are skipped; a head past its size or header-count limit fails the
response; a body with neither a length nor chunks ends with the connection. Bytes from the
replica with no request in flight make the connection unusable: they can only be a reply that
no one asked for.
"""

from __future__ import annotations

import asyncio
import select
import socket
import struct
import sys
from collections import deque
from typing import Protocol, cast

import httptools

_HIGH_WATER = 1 << 20

# Linux's struct tcp_info: tcpi_bytes_acked, a 64-bit count, at byte 120 (kernels since 4.1).
_TCP_INFO = getattr(socket, "TCP_INFO", None) if sys.platform.startswith("linux") else None
_BYTES_ACKED = struct.Struct("=Q")
_BYTES_ACKED_AT = 120

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
    def __init__(self, connection: Connection) -> None:
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
        """What of the body has come and was not read yet, as soon as there is some; b"" once
        it has ended."""
        while True:
            chunks = self._chunks
            if chunks:
                if len(chunks) == 1:
                    chunk = chunks.popleft()
                else:
                    # What arrived together leaves together: one write to the client (a
                    # system call) for the events of one read, not one per event.
                    chunk = b"".join(chunks)
                    chunks.clear()
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


class Owner(Protocol):
    """The pool a connection goes back to."""

    def put_back(self, connection: Connection) -> None: ...

    def forget(self, connection: Connection) -> None: ...


class Connection(asyncio.Protocol):
    """One request at a time: `send` writes it, httptools' callbacks fill its `Response`."""

    def __init__(self, owner: Owner, key: Origin, max_head_bytes: int, max_headers: int) -> None:
        self.owner = owner
        self.key = key
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.closed = False
        self.idle = False
        """In its pool's idle list."""
        self.resend: str | None = None
        """Why the request in flight, which failed, cannot have been read by the replica."""
        self._max_head = max_head_bytes
        self._max_headers = max_headers
        self._raw_headers: list[tuple[bytes, bytes]] = []
        self._head_seen = 0
        """Bytes received since the request while its response's head is incomplete; -1 after."""
        self._head_size = 0
        self._header_count = 0
        self._interim = False
        self._until_eof = False
        self._paused = False
        self._written = 0
        self._acked_before = -1
        """TCP bytes the peer had acknowledged once connected; -1: no such evidence here."""
        self._poll: select.poll | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self.transport is not None:  # the pool calls it too (see ConnectionPool._connect)
            return
        # uvloop's transports are not subclasses of asyncio.Transport, but behave as one.
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            self._poll = select.poll()
            self._poll.register(sock.fileno(), select.POLLIN)
        if not self.key[2]:
            self._acked_before = _bytes_acked(transport)

    def usable(self) -> bool:
        """Open, and nothing (not even an EOF) has come from the replica since its last reply."""
        if self.closed or self.transport is None or self.transport.is_closing():
            return False
        return self._poll is None or not self._poll.poll(0)

    def send(self, data: bytes) -> Response:
        transport = self.transport
        assert transport is not None
        response = self.response = Response(self)
        self._raw_headers = response.raw_headers
        self._head_seen = self._head_size = self._header_count = 0
        self._until_eof = False
        self.resend = None
        self._written += len(data)
        transport.write(data)
        if transport.is_closing():
            # Closing already, or the first send failed: none of the request left.
            self.resend = "write_failed"
            response.fail(HTTPClientError("closed", "upstream closed before the request went"))
        return response

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None or response.complete:
            self.close()  # nothing was asked: whatever this is, the next request would read it
            return
        if self._head_seen >= 0:
            self._head_seen += len(data)
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._broken(response, exc)
            return
        if self._head_seen > self._max_head:
            self._broken(response, self._head_too_large())

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        response = self.response
        if response is None:
            self._leave_pool()
            return
        if response.complete:
            return
        if self._head_seen < 0 and self._until_eof and exc is None:
            response.end()  # a body delimited by the connection's end
            return
        if self._head_seen == 0 and self.resend is None and self._unacknowledged():
            self.resend = "unacknowledged"
        response.fail(HTTPClientError("closed", "upstream closed the connection"))

    # httptools callbacks
    def on_message_begin(self) -> None:
        response = self.response
        if response is None or response.complete:
            raise HTTPClientError("protocol", "upstream sent more than one response")

    def on_status(self, reason: bytes) -> None:
        self._head_size += len(reason) + 15  # "HTTP/1.1 200 " and CRLF

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        self._head_size += len(name) + len(value) + 4
        if self._head_size > self._max_head:
            raise self._head_too_large()
        if self._header_count > self._max_headers:
            raise HTTPClientError("protocol", f"upstream response over {self._max_headers} headers")
        self._raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        response = self.response
        assert response is not None
        status = self.parser.get_status_code()
        if status < 200:
            if status == 101:
                raise HTTPClientError("protocol", "upstream switched protocols")
            self._interim = True  # 100 Continue, 103 Early Hints: the answer is still to come
            self._raw_headers.clear()
            return
        self._head_seen = -1
        response.status = status
        response.keep_alive = keep_alive = self.parser.should_keep_alive()
        if not keep_alive:
            self._until_eof = _ends_at_eof(response.raw_headers)
        if not response.started.done():
            response.started.set_result(None)

    def on_body(self, body: bytes) -> None:
        response = self.response
        assert response is not None
        response.feed(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        response = self.response
        assert response is not None
        response.end()

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
            self.owner.put_back(self)
        else:
            self.close()

    def close(self) -> None:
        self.closed = True
        self._leave_pool()
        if self.transport is not None:
            self.transport.close()

    def _leave_pool(self) -> None:
        if self.idle:
            self.idle = False
            self.owner.forget(self)

    def _broken(self, response: Response, exc: Exception) -> None:
        error = exc if isinstance(exc, HTTPClientError) else exc.__context__
        if not isinstance(error, HTTPClientError):
            error = HTTPClientError("protocol", f"bad upstream response: {exc}")
        response.fail(error)
        self.close()

    def _head_too_large(self) -> HTTPClientError:
        return HTTPClientError("protocol", f"upstream response head over {self._max_head} bytes")

    def _unacknowledged(self) -> bool:
        """Whether the peer's host had not acknowledged every byte written here: then what is
        missing never reached the replica, which cannot have read the request."""
        if self._acked_before < 0 or self.transport is None:
            return False
        acked = _bytes_acked(self.transport)
        return acked >= 0 and acked - self._acked_before < self._written


def _ends_at_eof(raw: list[tuple[bytes, bytes]]) -> bool:
    """Whether a response's body is delimited by the connection's end (no length, no chunks)."""
    for name, value in raw:
        lowered = name.lower()
        if lowered == b"content-length":
            return False
        if lowered == b"transfer-encoding" and value.rstrip().lower().endswith(b"chunked"):
            return False
    return True


def _bytes_acked(transport: asyncio.BaseTransport) -> int:
    """The TCP bytes the peer's host has acknowledged on this connection; -1 if unknown."""
    sock = transport.get_extra_info("socket")
    if _TCP_INFO is None or sock is None:
        return -1
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _BYTES_ACKED_AT + 8)
    except OSError:
        return -1
    if len(info) < _BYTES_ACKED_AT + 8:
        return -1
    acked: int = _BYTES_ACKED.unpack_from(info, _BYTES_ACKED_AT)[0]
    return acked
