"""Forwarding one routed request: attempts at replicas until one answers, failing over before
the first byte (docs/reliability.md); whatever happens, the result is one `Outcome`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections.abc import Callable
from email.utils import parsedate_to_datetime

from gateway.backends.health import Health
from gateway.backends.pool import Backend
from gateway.backends.stalls import PrefillSpeed
from gateway.metrics import Metrics
from gateway.prompt.parsing import Endpoint
from gateway.proxy.attempt import Attempt
from gateway.proxy.deadlines import Exchange, Interrupted, Why, client_error
from gateway.proxy.http1 import Response
from gateway.proxy.prefills import Prefills
from gateway.proxy.relay import NO_LISTENERS, Limits, Listeners, Relay, Relayed
from gateway.proxy.reply import Headers, Reply
from gateway.proxy.rewrite import request_usage, with_cache_salt
from gateway.proxy.upstream import Upstream, UpstreamError, interrupted, response_headers
from gateway.routing.routed import Routed
from gateway.routing.types import Decision, Outcome

_RETRY_STATUSES = frozenset({429, 502, 503, 504})
# Where `--observe-usage` asks a stream for usage (the Responses API's streams always carry it).
_USAGE_ASKED = frozenset({Endpoint.CHAT, Endpoint.COMPLETIONS})

GatewayHeaders = Callable[[Decision], Headers]
"""The gateway's own response headers for the attempt that answers."""


class Forwarder:
    def __init__(
        self,
        upstream: Upstream,
        health: Health,
        metrics: Metrics,
        limits: Limits,
        prefills: Prefills,
        max_attempts: int,
        retry_backoff: float,
        retry_after_cap: float,
        observe_usage: bool,
        speed: PrefillSpeed,
        rng: random.Random | None = None,
    ) -> None:
        self.upstream = upstream
        self._health = health
        self._metrics = metrics
        self._limits = limits
        self._relay = Relay(metrics, limits)
        self._prefills = prefills if prefills.max_wait > 0 else None
        self._max_attempts = max_attempts
        self._backoff = retry_backoff
        self._retry_after_cap = retry_after_cap
        self._observe_usage = observe_usage
        self._speed = speed
        self._rng = rng or random.Random()

    async def forward(
        self,
        routed: Routed,
        body: bytes,
        headers: Headers,
        exchange: Exchange,
        reply: Reply,
        gateway_headers: GatewayHeaders,
        *,
        method: bytes = b"POST",
        path: str | None = None,
        listeners: Listeners = NO_LISTENERS,
    ) -> Outcome:
        """Forward `routed`: `body` POSTed to its endpoint, or sent with `method` to `path`;
        `listeners` hear of the answer before the client has it all (see `Relay`)."""
        request = routed.request
        strip_usage = (
            self._observe_usage
            and request.stream
            and not request.wants_usage
            and request.endpoint in _USAGE_ASKED
        )
        if strip_usage:
            body = request_usage(body)
        if request.tenant is not None and request.endpoint.generates and method == b"POST":
            body = with_cache_salt(body, request.tenant)
        tries = _Tries(routed, method, path or request.endpoint.value, listeners)
        try:
            with exchange.guard():
                relayed = await self._attempts(
                    tries, body, headers, exchange, reply, gateway_headers, strip_usage
                )
        except Interrupted as stop:
            status = await self._cut_short(stop.why, tries, exchange, reply, gateway_headers)
            relayed = Relayed(status)
        except asyncio.CancelledError:
            # The server's own, at the end of its shutdown grace: answer what can be answered.
            relayed = Relayed(await self._cut_short(None, tries, exchange, reply, gateway_headers))
        finally:
            exchange.finish()
        seen = relayed.seen
        return Outcome(
            relayed.status,
            tries.decision,
            tuple(tries.tried),
            seen.prompt_tokens,
            seen.cached_tokens,
            seen.answer,
            seen.sent_at,
            tries.first_byte_at,
            seen.completion_tokens,
        )

    async def _attempts(
        self,
        tries: _Tries,
        body: bytes,
        headers: Headers,
        exchange: Exchange,
        reply: Reply,
        gateway_headers: GatewayHeaders,
        strip_usage: bool,
    ) -> Relayed:
        routed = tries.routed
        backend = routed.backend
        pause = 0.0
        while True:
            if pause > 0:
                await asyncio.sleep(pause)
            with Attempt(
                backend,
                tries.decision,
                routed.chain,
                self._prefills,
                routed.request.stream,
                exchange,
                self._speed,
            ) as attempt:
                await attempt.take_turn()
                exchange.expect(Why.FIRST_BYTE, self._limits.first_byte)
                attempt.sent()
                try:
                    with exchange.guard():
                        response = await self.upstream.send(
                            backend.url + tries.path,
                            body,
                            headers,
                            backend.source != "admin",
                            tries.method,
                        )
                except UpstreamError as unsent:
                    relayed, retry = Relayed(0, failure=unsent), None
                except Interrupted as stop:
                    missed = interrupted(stop.why, self._limits.first_byte)
                    if stop.why is Why.TOTAL or missed is None:  # not this attempt's end
                        raise
                    relayed, retry = Relayed(0, failure=missed), None
                else:
                    try:
                        relayed, retry = await self._answer(
                            attempt, tries, response, exchange, reply, gateway_headers, strip_usage
                        )
                    finally:
                        # Closes the connection unless the response was read to its end: a
                        # replica whose client left sees its request aborted at once.
                        response.release()
                tries.first_byte_at = attempt.first_byte_at
            failed = relayed.failure
            if failed is not None:
                # A stall was already held against the backend; a total deadline is the client's.
                blamed = failed.cause not in ("request_timeout", "stalled")
                self._failed(backend, failed.cause, blame=blamed)
            if relayed.status:
                return relayed
            if retry is None:
                assert failed is not None
                retry = (failed.cause, None)
            moved = self._next(tries, *retry)
            if moved is None:
                assert failed is not None, "a retryable status is relayed when nothing is left"
                await reply.fail(failed.error, gateway_headers(tries.decision))
                return Relayed(failed.error.status, failure=failed)
            backend, pause = moved

    async def _answer(
        self,
        attempt: Attempt,
        tries: _Tries,
        response: Response,
        exchange: Exchange,
        reply: Reply,
        gateway_headers: GatewayHeaders,
        strip_usage: bool,
    ) -> tuple[Relayed, tuple[str, float | None] | None]:
        """Relay `response`, unless its status asks for another replica and one is left: then
        `Relayed(0)`, the retry's cause and its pause."""
        backend = attempt.backend
        status = response.status
        if status >= 500:
            self._failed(backend, f"status_{status}")
        else:
            self._health.request_succeeded(backend)
            if status < 300:
                tries.routed.accepted(backend.name)
        if status in _RETRY_STATUSES:
            after = _retry_after(response.headers.get("retry-after")) if status == 429 else None
            if (after is None or after <= self._retry_after_cap) and self._can_move(tries):
                return Relayed(0), (f"status_{status}", after)
        out_headers = response_headers(response.raw_headers)
        out_headers.extend(gateway_headers(tries.decision))
        stream = tries.routed.request.stream
        relayed = await self._relay(
            attempt, exchange, response, out_headers, reply, stream, strip_usage, tries.listeners
        )
        return relayed, None

    def _can_move(self, tries: _Tries) -> bool:
        if len(tries.tried) >= self._max_attempts:
            return False
        tries.upcoming = tries.routed.fallback(tries.tried)
        return tries.upcoming is not None

    def _next(
        self, tries: _Tries, cause: str, retry_after: float | None
    ) -> tuple[Backend, float] | None:
        """The next backend and the pause before trying it, or None: this failure is final."""
        if tries.upcoming is None and not self._can_move(tries):
            return None
        assert tries.upcoming is not None
        backend, decision = tries.upcoming
        tries.upcoming = None
        attempt = len(tries.tried)
        pause = self._backoff * 2.0 ** (attempt - 1) * self._rng.random()
        if retry_after is not None:
            pause = max(pause, retry_after)
        self._metrics.retries.labels(cause).inc()
        tries.decision = decision
        tries.tried.append(backend.name)
        return backend, pause

    def _failed(self, backend: Backend, cause: str, blame: bool = True) -> None:
        self._metrics.upstream_errors.labels(backend.name, cause).inc()
        if blame:
            self._health.request_failed(backend, cause)

    async def _cut_short(
        self,
        why: Why | None,
        tries: _Tries,
        exchange: Exchange,
        reply: Reply,
        gateway_headers: GatewayHeaders,
    ) -> int:
        """Finish a request interrupted by its client, a deadline or the server's shutdown."""
        limits = self._limits
        error = client_error(why, limits.idle if why is Why.IDLE else limits.total)
        if error is None:
            self._metrics.client_disconnects.labels(tries.routed.request.model).inc()
            return 499
        if exchange.done and reply.begun:
            return error.status  # its last bytes are on their way
        with contextlib.suppress(Exception):  # the connection may be gone already
            await reply.fail(error, gateway_headers(tries.decision))
        return error.status


class _Tries:
    """The attempts so far: the decision of the latest and every backend tried."""

    __slots__ = (
        "decision", "first_byte_at", "listeners", "method", "path", "routed", "tried", "upcoming"
    )

    def __init__(
        self, routed: Routed, method: bytes, path: str, listeners: Listeners
    ) -> None:
        self.routed = routed
        self.method = method
        self.path = path
        self.listeners = listeners
        self.decision = routed.decision
        self.tried = [routed.backend.name]
        self.upcoming: tuple[Backend, Decision] | None = None
        self.first_byte_at = 0.0


def _retry_after(value: str | None) -> float | None:
    """Seconds to wait from a `Retry-After` header (delta-seconds or an HTTP date)."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError):
            return None
    return max(0.0, seconds) if math.isfinite(seconds) else None
