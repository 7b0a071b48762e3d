"""The response to the client, begun once: its only writer, so an error always takes the shape
that still fits (an error body, a last SSE event, or nothing). Each error it tells the client is
counted as a refusal (`prefix_gateway/refusals.py`); one it can no longer tell is not.
"""

from __future__ import annotations

from collections.abc import Awaitable

from prefix_gateway.errors import OPENAI, ErrorShape, GatewayError
from prefix_gateway.metrics import Metrics
from prefix_gateway.proxy.asgi import Send, send_error
from prefix_gateway.proxy.deadlines import ClientConnection
from prefix_gateway.refusals import count_refusal

Headers = list[tuple[bytes, bytes]]


class Reply:
    __slots__ = ("_connection", "_last", "_metrics", "_send", "_shape", "begun", "streaming")

    def __init__(
        self,
        send: Send,
        metrics: Metrics,
        connection: ClientConnection | None = None,
        shape: ErrorShape = OPENAI,
    ) -> None:
        """`connection`: the server's, which can close it at once (`CLIENT_CONNECTION`);
        `shape`: how the client expects its errors."""
        self._send = send
        self._shape = shape
        self._metrics = metrics
        self._connection = connection
        self.begun = False
        self.streaming = False
        self._last = b""
        """The last chunk of the stream sent."""

    async def whole(self, status: int, headers: Headers, body: bytes) -> None:
        headers.append((b"content-length", str(len(body)).encode()))
        self.begun = True
        await self._send({"type": "http.response.start", "status": status, "headers": headers})
        await self._send({"type": "http.response.body", "body": body})

    async def start(self, status: int, headers: Headers) -> None:
        """Begin a body sent in chunks that is not an event stream (it cannot end in an
        error event: one cut short is left short)."""
        self.begun = True
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def start_stream(self, headers: Headers) -> None:
        self.begun = self.streaming = True
        await self._send({"type": "http.response.start", "status": 200, "headers": headers})

    def chunk(self, data: bytes) -> Awaitable[None]:
        """Send a non-empty chunk of the stream, once awaited. Not a coroutine of its own: it
        runs once per chunk of every stream."""
        self._last = data
        return self._send({"type": "http.response.body", "body": data, "more_body": True})

    def drop(self) -> None:
        """Close a connection whose client stopped reading: a response it does not take is
        left unfinished rather than held in its buffers."""
        if self._connection is not None:
            self._connection.drop()

    async def end(self, data: bytes = b"") -> None:
        await self._send({"type": "http.response.body", "body": data})

    async def fail(self, error: GatewayError, headers: Headers) -> None:
        """Tell the client why its request ended, in whatever shape still fits."""
        if not self.begun:
            self.begun = True
            count_refusal(self._metrics, error)
            await send_error(self._send, error, headers, self._shape)
        elif self.streaming:
            count_refusal(self._metrics, error)
            # An event cut in the middle is closed first, so that the error is one of its own.
            last = self._last
            cut = bool(last) and not last.endswith((b"\n\n", b"\r\n\r\n"))
            event = self._shape.event(error)
            tail = b"\n\n" + event if cut else event
            await self.end(tail)
