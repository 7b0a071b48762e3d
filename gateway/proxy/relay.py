"""Relaying one replica's response to the client as it arrives. Until the first chunk is sent
the attempt may still fail over, so the relay returns that failure instead of answering; a
stream that breaks later ends with an SSE error event.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from gateway.config import Settings
from gateway.metrics import Metrics
from gateway.proxy.attempt import Attempt
from gateway.proxy.deadlines import Interrupted, Why
from gateway.proxy.forwarding import Forwarding
from gateway.proxy.http1 import HTTPClientError, Response
from gateway.proxy.reply import Headers
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


# What the last event of a stream carries; a chunk holding it is read before it is relayed.
_LAST_EVENT = re.compile(rb"\[DONE\]|response\.(?:completed|incomplete|failed)")


@dataclass(frozen=True, slots=True)
class Timeouts:
    first_byte: float
    idle: float
    total: float
    client_write: float

    @classmethod
    def of(cls, settings: Settings) -> Timeouts:
        return cls(
            settings.first_byte_timeout,
            settings.stream_idle_timeout,
            settings.request_timeout,
            settings.client_write_timeout,
        )


class Relay:
    def __init__(self, metrics: Metrics, limits: Timeouts) -> None:
        self._metrics = metrics
        self._limits = limits

    async def __call__(
        self, forwarding: Forwarding, attempt: Attempt, response: Response, headers: Headers
    ) -> Relayed:
        """Relay `response` with `headers`. Its placement hears of a successful answer (and of
        a Responses API response's id) before the client has it all."""
        status = response.status
        if forwarding.placement.request.stream and status == 200:
            return await self._stream(forwarding, attempt, response, headers)
        exchange = forwarding.exchange
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
        placement = forwarding.placement
        stored, hears_answer = placement.hears_response_id, placement.hears_answer
        if status == 200 and (stored or hears_answer):
            # Read before the client has the body: what it starts must be known first.
            seen = observe_body(payload)
            name = attempt.backend.name
            if stored and seen.response_id is not None:
                await placement.response_stored(seen.response_id, name)
            if hears_answer:
                await placement.answer_complete(name, seen.answer, seen.completion_tokens)
        await forwarding.reply.whole(status, headers, payload)
        self._ended(attempt)
        if seen is None:
            seen = observe_body(payload) if status == 200 else Observation()
        seen.sent_at = attempt.started
        return Relayed(status, seen)

    async def _stream(
        self, forwarding: Forwarding, attempt: Attempt, response: Response, headers: Headers
    ) -> Relayed:
        exchange, reply = forwarding.exchange, forwarding.reply
        strip_usage = forwarding.strip_usage
        try:
            with exchange.guard():
                chunk = await response.readany()
        except HTTPClientError as exc:
            return Relayed(0, failure=failure_of(exc))
        except Interrupted as stop:
            return Relayed(0, failure=self._first_byte_missed(stop))
        self._first_byte(attempt)
        idle, client_write = self._limits.idle, self._limits.client_write
        clock = time.monotonic
        backend = attempt.backend
        now = clock()
        exchange.expect(Why.IDLE, idle)
        observer = StreamObserver(strip_usage)
        seen = observer.seen
        seen.sent_at = attempt.started
        await reply.start_stream(headers)
        placement = forwarding.placement
        stored, hears_answer = placement.hears_response_id, placement.hears_answer
        failed: UpstreamError | None = None
        looked = True
        try:
            with exchange.guard():
                while chunk:
                    # Without stripping a chunk leaves before it is looked at, unless it may
                    # end the answer that the placement is to hear of first.
                    looked = strip_usage or (
                        hears_answer and _LAST_EVENT.search(chunk) is not None
                    )
                    passed = observer.feed(chunk) if looked else chunk
                    if hears_answer and seen.complete:
                        await placement.answer_complete(
                            backend.name, seen.answer, seen.completion_tokens
                        )
                        hears_answer = False
                    if passed:
                        # While the chunk waits for the client, the attempt is not judged
                        # for a stall (`Attempt.awaiting_client`): its replica cannot send.
                        exchange.phase = Why.CLIENT_STALLED
                        exchange.due = now + client_write
                        await reply.chunk(passed)
                        now = clock()
                        attempt.judged_from = now
                        exchange.phase = Why.IDLE
                        exchange.due = now + idle
                    if not looked:
                        observer.feed(chunk)
                    if stored and seen.response_id is not None:
                        # Once, at `response.created`: long before the client could name it.
                        await placement.response_stored(seen.response_id, backend.name)
                        stored = False
                    chunk = await response.readany()
                    now = clock()
                    exchange.due = now + idle
                    backend.progressed(now)
        except HTTPClientError:
            failed = failure("stream_broken")
        except Interrupted as stop:
            if exchange.phase is Why.CLIENT_STALLED and not looked:
                # The replica sent this chunk whole (the client may have it): its usage counts.
                observer.feed(chunk)
            failed = interrupted(stop.why, idle if stop.why is Why.IDLE else self._limits.total)
            if failed is None:  # the client went away, or stopped reading
                if stop.why is Why.CLIENT_STALLED:
                    reply.drop()  # what waits in its buffers is never to be sent
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

