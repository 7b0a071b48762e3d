"""Relaying one replica's response to the client as it arrives. Until the first chunk is sent
the attempt may still fail over, so the relay returns that failure instead of answering; a
stream that breaks later ends with an SSE error event.

A non-streamed body up to `--whole-reply-bytes` is read whole first, so that its answer and a
stored response's id are recorded before the client has it; a larger one is passed on as it
arrives (the replica's content-length with it), its usage read from its last bytes, and a body
that breaks off is left cut short (the connection closes).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from prefix_gateway.config import Settings
from prefix_gateway.metrics import Metrics
from prefix_gateway.proxy.attempt import Attempt
from prefix_gateway.proxy.deadlines import Exchange, Interrupted, Why
from prefix_gateway.proxy.forwarding import Forwarding
from prefix_gateway.proxy.http1 import HTTPClientError, Response
from prefix_gateway.proxy.reply import Headers, Reply
from prefix_gateway.proxy.upstream import UpstreamError, failure, failure_of, interrupted
from prefix_gateway.proxy.usage import (
    Observation,
    StreamObserver,
    observe_body,
    opening_id,
    usage_in_tail,
)


@dataclass(slots=True)
class Relayed:
    """What relaying one response came to."""

    status: int
    """The status the client was given (0: nothing was sent)."""
    seen: Observation = field(default_factory=Observation)
    failure: UpstreamError | None = None
    """Why the response failed, if it did; with status 0 the attempt may fail over."""


# What the last event of a stream carries; a chunk holding it is read before it is relayed.
_LAST_EVENT = re.compile(rb"\[DONE\]|response\.(?:completed|incomplete|failed)|message_stop")
_OPENING = 1024  # bytes of a passed-on body looked at for its shape and id
_TAIL = 64 * 1024  # bytes at the end of a passed-on body kept for its usage


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


@dataclass(frozen=True, slots=True)
class ReplyLimits:
    whole_bytes: int
    """A non-streamed body read whole before it is sent (larger: passed on as it arrives)."""
    answer_chars: int
    """Answer text kept for the next turn at most (what its prompt can use)."""

    @classmethod
    def of(cls, settings: Settings) -> ReplyLimits:
        answer = round(settings.max_prompt_tokens * settings.chars_per_token)
        return cls(settings.whole_reply_bytes, answer)


class Relay:
    def __init__(self, metrics: Metrics, limits: Timeouts, replies: ReplyLimits) -> None:
        self._metrics = metrics
        self._limits = limits
        self._replies = replies

    async def __call__(
        self, forwarding: Forwarding, attempt: Attempt, response: Response, headers: Headers
    ) -> Relayed:
        """Relay `response` with `headers`. Its placement hears of a successful answer (and of
        a Responses API response's id) before the client has it all."""
        status = response.status
        if forwarding.placement.request.stream and status == 200:
            return await self._stream(forwarding, attempt, response, headers)
        exchange = forwarding.exchange
        held: list[bytes] = []
        size, bound = 0, self._replies.whole_bytes
        try:
            with exchange.guard():
                while size <= bound and (chunk := await response.readany()):
                    held.append(chunk)
                    size += len(chunk)
        except HTTPClientError as exc:
            return Relayed(0, failure=failure_of(exc))
        except Interrupted as stop:
            return Relayed(0, failure=self._first_byte_missed(stop))
        if size > bound:
            return await self._pass_on(forwarding, attempt, response, headers, held)
        payload = b"".join(held)
        del held
        self._first_byte(attempt)
        seen = None
        placement = forwarding.placement
        stored, hears_answer = placement.hears_response_id, placement.hears_answer
        answer_limit = self._replies.answer_chars
        if status == 200 and (stored or hears_answer):
            # Read before the client has the body: what it starts must be known first.
            seen = observe_body(payload, answer_limit)
            name = attempt.backend.name
            if stored and seen.response_id is not None:
                await placement.response_stored(seen.response_id, name)
            if hears_answer:
                await placement.answer_complete(name, seen.answer, seen.completion_tokens)
        # Interrupted here, a client that stopped reading ends the request as a stream's does.
        exchange.expect(Why.CLIENT_STALLED, self._limits.client_write)
        try:
            await forwarding.reply.whole(status, headers, payload)
        finally:
            # Read once it is on its way (the client waits for no parse), whatever became of it.
            if seen is None:
                seen = observe_body(payload, answer_limit) if status == 200 else Observation()
            seen.sent_at = attempt.started
            seen.answered = status < 300
            forwarding.seen = seen
        exchange.finish()
        self._ended(attempt)
        return Relayed(status, seen, _malformed() if seen.malformed else None)

    async def _pass_on(
        self,
        forwarding: Forwarding,
        attempt: Attempt,
        response: Response,
        headers: Headers,
        held: list[bytes],
    ) -> Relayed:
        """Send a body too large to hold as it arrives: what is `held`, then the rest, at the
        client's pace. Its answer is not recorded (too long for a next turn's prompt, most
        likely); a stored response's id is read from its opening bytes."""
        exchange, reply = forwarding.exchange, forwarding.reply
        self._first_byte(attempt)
        status = response.status
        opening = b"".join(held[:8])[:_OPENING]
        seen = Observation(sent_at=attempt.started, answered=status < 300)
        forwarding.seen = seen
        if status == 200:
            seen.malformed = not opening.lstrip().startswith(b"{")
            seen.response_id = opening_id(opening)
            placement = forwarding.placement
            if placement.hears_response_id and seen.response_id is not None:
                await placement.response_stored(seen.response_id, attempt.backend.name)
        length = response.headers.get("content-length")
        if length is not None:
            headers.append((b"content-length", length.encode("latin-1")))
        await reply.start(status, headers)
        idle = self._limits.idle
        clock = time.monotonic
        backend = attempt.backend
        exchange.expect(Why.IDLE, idle)
        tail = b""
        failed: UpstreamError | None = None
        try:
            with exchange.guard():
                while held:
                    chunk = held.pop(0)
                    tail = (tail + chunk)[-_TAIL:]
                    await self._to_client(exchange, attempt, reply, chunk)
                while chunk := await response.readany():
                    now = clock()
                    exchange.due = now + idle
                    backend.progressed(now)
                    tail = (tail + chunk)[-_TAIL:]
                    await self._to_client(exchange, attempt, reply, chunk)
        except HTTPClientError:
            failed = failure("stream_broken")
        except Interrupted as stop:
            failed = interrupted(stop.why, idle if stop.why is Why.IDLE else self._limits.total)
            if failed is None:  # the client went away, or stopped reading
                if stop.why is Why.CLIENT_STALLED:
                    reply.drop()
                raise
        exchange.finish()
        if failed is not None:
            # Its head is sent: the client finds the body short of its length, its
            # connection closed at once.
            reply.drop()
            return Relayed(failed.error.status, seen, failed)
        await reply.end()
        self._ended(attempt)
        if status == 200:
            seen.take_usage(usage_in_tail(tail))
        return Relayed(status, seen, _malformed() if seen.malformed else None)

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
        self._first_byte(attempt, streamed=True)
        idle, client_write = self._limits.idle, self._limits.client_write
        clock = time.monotonic
        backend = attempt.backend
        now = clock()
        exchange.expect(Why.IDLE, idle)
        observer = StreamObserver(strip_usage, self._replies.answer_chars, forwarding.counts_tokens)
        seen = observer.seen
        seen.sent_at = attempt.started
        seen.answered = True
        forwarding.seen = seen
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
                    looked = strip_usage or (hears_answer and _LAST_EVENT.search(chunk) is not None)
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

    async def _to_client(
        self, exchange: Exchange, attempt: Attempt, reply: Reply, chunk: bytes
    ) -> None:
        """Send a chunk of a passed-on body; while it waits, the client is judged (within
        `--client-write-timeout`), not the replica."""
        exchange.phase = Why.CLIENT_STALLED
        exchange.due = time.monotonic() + self._limits.client_write
        await reply.chunk(chunk)
        now = time.monotonic()
        attempt.judged_from = now
        exchange.phase = Why.IDLE
        exchange.due = now + self._limits.idle

    def _first_byte_missed(self, stop: Interrupted) -> UpstreamError:
        missed = interrupted(stop.why, self._limits.first_byte)
        if stop.why is Why.TOTAL or missed is None:  # the request's end, not the attempt's
            raise stop
        return missed

    def _first_byte(self, attempt: Attempt, streamed: bool = False) -> None:
        """`streamed`: the first event of a streamed answer, its time to first token."""
        waited = attempt.reached_first_byte()
        name = attempt.backend.name
        stream = "true" if streamed else "false"
        self._metrics.child(self._metrics.first_byte_seconds, name, stream).observe(waited)

    def _ended(self, attempt: Attempt) -> None:
        took = time.perf_counter() - attempt.started
        name = attempt.backend.name
        self._metrics.child(self._metrics.duration_seconds, name).observe(took)


def _malformed() -> UpstreamError:
    """A 200 whose body is not the endpoint's JSON: relayed as it is, held against the replica."""
    return failure("malformed")
