"""Relaying one replica's response to the client as it arrives. Until the first chunk is sent
the attempt may still fail over, so the relay returns that failure instead of answering; a
stream that breaks later ends with an SSE error event.
"""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from gateway.metrics import Metrics
from gateway.proxy.attempt import Attempt
from gateway.proxy.deadlines import Exchange, Interrupted, Why
from gateway.proxy.http1 import HTTPClientError, Response
from gateway.proxy.reply import Headers, Reply
from gateway.proxy.upstream import UpstreamError, failure, failure_of, interrupted
from gateway.proxy.usage import Observation, StreamObserver, observe_body


@dataclass(slots=True)
class Relayed:
    """What relaying one response came to."""

    status: int
    """The status the client was given (0: nothing was sent)."""
    seen: Observation = field(default_factory=Observation)
    failure: UpstreamError | None = None
    """Why the response failed, if it did; with status 0 the attempt may fail over."""


Remember = Callable[[str, str], Awaitable[None]]
"""Told `(response id, backend)` of a Responses API response before the client can use the id."""
Answered = Callable[[str, Observation], Awaitable[None]]
"""Told `(backend, what was seen)` of a whole answer before the client has its last bytes."""

# What the last event of a stream carries; a chunk holding it is read before it is relayed.
_LAST_EVENT = re.compile(rb"\[DONE\]|response\.(?:completed|incomplete|failed)")


@dataclass(frozen=True, slots=True)
class Listeners:
    """Who hears of a response before its client has all of it."""

    remember: Remember | None = None
    answered: Answered | None = None


NO_LISTENERS = Listeners()


@dataclass(frozen=True, slots=True)
class Limits:
    first_byte: float
    idle: float
    total: float


class Relay:
    def __init__(self, metrics: Metrics, limits: Limits) -> None:
        self._metrics = metrics
        self._limits = limits

    async def __call__(
        self,
        attempt: Attempt,
        exchange: Exchange,
        response: Response,
        headers: Headers,
        reply: Reply,
        stream: bool,
        strip_usage: bool,
        listeners: Listeners = NO_LISTENERS,
    ) -> Relayed:
        """Relay `response`; with `strip_usage` the usage the gateway asked for is held back.
        `listeners` hear of a successful answer before the client has it all."""
        status = response.status
        if stream and status == 200:
            return await self._stream(
                attempt, exchange, response, headers, reply, strip_usage, listeners
            )
        try:
            with exchange.guard():
                payload = await response.read()
        except HTTPClientError as exc:
            return Relayed(0, failure=failure_of(exc))
        except Interrupted as stop:
            return Relayed(0, failure=self._first_byte_missed(stop))
        exchange.finish()
        self._first_byte(attempt)
        seen = None
        remember, answered = listeners.remember, listeners.answered
        if status == 200 and (remember is not None or answered is not None):
            # Read before the client has the body: what it starts must be known first.
            seen = observe_body(payload)
            name = attempt.backend.name
            if remember is not None and seen.response_id is not None:
                await remember(seen.response_id, name)
            if answered is not None:
                await answered(name, seen)
        await reply.whole(status, headers, payload)
        self._ended(attempt)
        if seen is None:
            seen = observe_body(payload) if status == 200 else Observation()
        seen.sent_at = attempt.started
        return Relayed(status, seen)

    async def _stream(
        self,
        attempt: Attempt,
        exchange: Exchange,
        response: Response,
        headers: Headers,
        reply: Reply,
        strip_usage: bool,
        listeners: Listeners,
    ) -> Relayed:
        try:
            with exchange.guard():
                chunk = await response.readany()
        except HTTPClientError as exc:
            return Relayed(0, failure=failure_of(exc))
        except Interrupted as stop:
            return Relayed(0, failure=self._first_byte_missed(stop))
        self._first_byte(attempt)
        idle = self._limits.idle
        clock = time.monotonic
        backend = attempt.backend
        exchange.expect(Why.IDLE, idle)
        observer = StreamObserver(strip_usage)
        seen = observer.seen
        seen.sent_at = attempt.started
        await reply.start_stream(headers)
        remember, answered = listeners.remember, listeners.answered
        failed: UpstreamError | None = None
        try:
            with exchange.guard():
                while chunk:
                    # Without stripping a chunk leaves before it is looked at, unless it may
                    # end the answer that `answered` is to hear of first.
                    looked = strip_usage or (
                        answered is not None and _LAST_EVENT.search(chunk) is not None
                    )
                    passed = observer.feed(chunk) if looked else chunk
                    if answered is not None and seen.complete:
                        await answered(backend.name, seen)
                        answered = None
                    if passed:
                        exchange.phase = Why.CLIENT_STALLED
                        await reply.chunk(passed)
                        exchange.phase = Why.IDLE
                    if not looked:
                        observer.feed(chunk)
                    if remember is not None and seen.response_id is not None:
                        # Once, at `response.created`: long before the client could name it.
                        await remember(seen.response_id, backend.name)
                        remember = None
                    chunk = await response.readany()
                    now = clock()
                    exchange.due = now + idle
                    backend.progressed_at = now
        except HTTPClientError:
            failed = failure("stream_broken")
        except Interrupted as stop:
            failed = interrupted(stop.why, idle if stop.why is Why.IDLE else self._limits.total)
            if failed is None:  # the client went away
                if not seen.complete:
                    raise
                # The client left once it had every event it needs: answered all the same.
                return Relayed(200, seen)
        exchange.finish()
        if failed is None:
            await reply.end(observer.finish())
            self._ended(attempt)
            return Relayed(200, seen)
        held = observer.rest()
        if held:
            await reply.chunk(held)
        await reply.fail(failed.error, [])
        return Relayed(failed.error.status, seen, failed)

    def _first_byte_missed(self, stop: Interrupted) -> UpstreamError:
        missed = interrupted(stop.why, self._limits.first_byte)
        if stop.why is Why.TOTAL or missed is None:  # the request's end, not the attempt's
            raise stop
        return missed

    def _first_byte(self, attempt: Attempt) -> None:
        waited = attempt.reached_first_byte()
        name = attempt.backend.name
        self._metrics.child(self._metrics.first_byte_seconds, name).observe(waited)

    def _ended(self, attempt: Attempt) -> None:
        took = time.perf_counter() - attempt.started
        name = attempt.backend.name
        self._metrics.child(self._metrics.duration_seconds, name).observe(took)

