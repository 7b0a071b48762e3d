"""Relaying one replica's response to the client, as it arrives.

A non-streamed response is read whole, then sent. A stream is sent chunk by chunk, each as it
comes (no coalescing); the response to the client begins only with the first chunk, so that
until then the request may still fail over (`BeforeFirstByte`). A stream that breaks, or goes
quiet, after its first byte ends with an SSE error event.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from gateway.backends.pool import Backend
from gateway.errors import GatewayError, UpstreamFailed, UpstreamTimeout, sse_error
from gateway.metrics import Metrics
from gateway.proxy.asgi import Send
from gateway.proxy.deadlines import CLIENT_STALLED, FIRST_BYTE, IDLE, TOTAL, Exchange
from gateway.proxy.upstream import (
    UPSTREAM_EXCEPTIONS,
    UpstreamError,
    UpstreamResponse,
    upstream_error,
)
from gateway.proxy.usage import Observation, StreamObserver, observe_body
from gateway.routing.router import RoutedRequest

Failed = Callable[[Backend, str, bool], None]
"""Told of a failure of `backend` with a metric cause; True: held against its health."""


class BeforeFirstByte(Exception):
    """An attempt failed after the replica's headers but before anything reached the client."""

    def __init__(self, failure: UpstreamError) -> None:
        super().__init__(failure.cause)
        self.failure = failure


def first_byte_missed(exchange: Exchange, timeout: float) -> UpstreamError | None:
    """Inside `except CancelledError`: the failure when it was the first-byte timeout."""
    if exchange.reason != FIRST_BYTE:
        return None
    exchange.resume()
    message = f"upstream sent nothing within {timeout:g} s"
    return UpstreamError("timeout", UpstreamTimeout(message, code="first_byte_timeout"))


def stream_timeout(reason: str, seconds: float) -> tuple[str, GatewayError]:
    """The metric cause and the error of a response that ran out of time once begun."""
    if reason == TOTAL:
        message = f"the request took longer than {seconds:g} s"
        return "request_timeout", UpstreamTimeout(message, code="request_timeout")
    message = f"upstream sent nothing for {seconds:g} s"
    return "stream_idle", UpstreamTimeout(message, code="stream_idle_timeout")


class Relay:
    def __init__(
        self, metrics: Metrics, first_byte_timeout: float, idle_timeout: float, failed: Failed
    ) -> None:
        self._metrics = metrics
        self._first_byte_timeout = first_byte_timeout
        self._idle_timeout = idle_timeout
        self._failed = failed

    async def __call__(
        self,
        routed: RoutedRequest,
        exchange: Exchange,
        response: UpstreamResponse,
        out_headers: list[tuple[bytes, bytes]],
        started: float,
        send: Send,
        strip_usage: bool = False,
    ) -> tuple[int, Observation]:
        """Relay `response`; the status the client was given and what the response said.

        `strip_usage`: the gateway asked for the stream's usage; the client does not get it.
        """
        status = response.status
        if routed.input.stream and status == 200:
            return await self._stream(
                routed, exchange, response, out_headers, started, send, strip_usage
            )
        payload = await self._first_read(exchange, response.read())
        exchange.done = True
        backend_name = routed.backend.name
        routed.reached_first_byte()
        self._metrics.child(self._metrics.first_byte_seconds, backend_name).observe(
            routed.first_byte_at - started
        )
        out_headers.append((b"content-length", str(len(payload)).encode()))
        exchange.begun = True
        await send({"type": "http.response.start", "status": status, "headers": out_headers})
        await send({"type": "http.response.body", "body": payload})
        self._metrics.child(self._metrics.duration_seconds, backend_name).observe(
            time.perf_counter() - started
        )
        seen = observe_body(payload) if status == 200 else Observation()
        seen.sent_at = started
        return status, seen

    async def _stream(
        self,
        routed: RoutedRequest,
        exchange: Exchange,
        response: UpstreamResponse,
        out_headers: list[tuple[bytes, bytes]],
        started: float,
        send: Send,
        strip_usage: bool,
    ) -> tuple[int, Observation]:
        content = response.content
        chunk = await self._first_read(exchange, content.readany())
        backend = routed.backend
        routed.reached_first_byte()
        self._metrics.child(self._metrics.first_byte_seconds, backend.name).observe(
            routed.first_byte_at - started
        )
        idle = self._idle_timeout
        clock = time.monotonic
        exchange.expect(IDLE, idle)
        observer = StreamObserver(strip_usage)
        observer.seen.sent_at = started
        exchange.begun = exchange.streaming = True
        await send({"type": "http.response.start", "status": 200, "headers": out_headers})
        failure: tuple[str, GatewayError] | None = None
        last = b""
        try:
            while chunk:
                # Without stripping the chunk leaves before it is looked at.
                passed = observer.feed(chunk) if strip_usage else chunk
                if passed:
                    try:
                        await send(
                            {"type": "http.response.body", "body": passed, "more_body": True}
                        )
                    except asyncio.CancelledError:
                        if exchange.reason == IDLE:
                            exchange.reason = CLIENT_STALLED
                        raise
                    last = passed
                if not strip_usage:
                    observer.feed(chunk)
                chunk = await content.readany()
                exchange.due = clock() + idle
        except asyncio.CancelledError:
            reason = exchange.reason
            if reason not in (IDLE, TOTAL):
                raise
            exchange.resume()
            failure = stream_timeout(reason, idle)
        except UPSTREAM_EXCEPTIONS as exc:
            failure = (
                "stream_broken",
                UpstreamFailed(
                    f"the upstream response broke off: {type(exc).__name__}", code="stream_broken"
                ),
            )
        exchange.done = True
        if failure is None:
            await send({"type": "http.response.body", "body": observer.finish()})
            self._metrics.child(self._metrics.duration_seconds, backend.name).observe(
                time.perf_counter() - started
            )
            return 200, observer.seen
        cause, error = failure
        self._failed(backend, cause, cause != "request_timeout")
        # An event cut in the middle is closed first, so that the error is an event of its own.
        tail = sse_error(error)
        held = observer.rest()
        if held:
            last = held
        if last and not last.endswith((b"\n\n", b"\r\n\r\n")):
            tail = b"\n\n" + tail
        tail = held + tail
        await send({"type": "http.response.body", "body": tail})
        return error.status, observer.seen

    async def _first_read(self, exchange: Exchange, read: Awaitable[bytes]) -> bytes:
        """The first read of a body: its failures still leave the request free to fail over."""
        try:
            return await read
        except asyncio.CancelledError:
            missed = first_byte_missed(exchange, self._first_byte_timeout)
            if missed is None:
                raise
            raise BeforeFirstByte(missed) from None
        except UPSTREAM_EXCEPTIONS as exc:
            raise BeforeFirstByte(upstream_error(exc)) from exc
