"""Forwarding one routed request: attempts at replicas until one answers, failing over before
the first byte (docs/reliability.md); whatever happens, the result is one `Outcome`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from email.utils import parsedate_to_datetime

from prefix_gateway.backends.backend import Backend
from prefix_gateway.backends.health import Health
from prefix_gateway.backends.pool import Lease
from prefix_gateway.backends.prefill_speed import PrefillSpeed
from prefix_gateway.config import Settings
from prefix_gateway.metrics import Metrics
from prefix_gateway.prompt.parsing import Endpoint
from prefix_gateway.proxy.attempt import Attempt
from prefix_gateway.proxy.deadlines import Interrupted, Why, client_error
from prefix_gateway.proxy.forwarding import Forwarding
from prefix_gateway.proxy.http1 import Response
from prefix_gateway.proxy.prefills import Prefills
from prefix_gateway.proxy.relay import Relay, Relayed, ReplyLimits, Timeouts
from prefix_gateway.proxy.rewrite import request_usage, with_cache_salt, with_priority
from prefix_gateway.proxy.upstream import Upstream, UpstreamError, interrupted, response_headers
from prefix_gateway.refusals import refused
from prefix_gateway.routing.types import Decision, Outcome

_RETRY_STATUSES = frozenset({429, 502, 503, 504})
# Where `--observe-usage` asks a stream for usage (the Responses API's streams always carry it).
_USAGE_ASKED = frozenset({Endpoint.CHAT, Endpoint.COMPLETIONS})
# vLLM schedules every request that runs the model by its `priority`, pooling ones too (their
# requests take the field as the generating ones do); tokenizing runs no model. Its Messages
# endpoint has no such field, but the chat path it hands requests to reads the header.
_PRIORITISED = frozenset(Endpoint) - {
    Endpoint.TOKENIZE,
    Endpoint.DETOKENIZE,
    Endpoint.COUNT_TOKENS,
    Endpoint.MESSAGES,
}
_ENGINE_PRIORITY_HEADER = b"x-vllm-priority"
"""Read by vLLM before the body's `priority` (chat, completions, responses)."""


class Forwarder:
    def __init__(
        self,
        settings: Settings,
        upstream: Upstream,
        health: Health,
        metrics: Metrics,
        prefills: Prefills,
        speed: PrefillSpeed,
        rng: random.Random | None = None,
    ) -> None:
        self.upstream = upstream
        self._health = health
        self._metrics = metrics
        self._limits = Timeouts.of(settings)
        self._relay = Relay(metrics, self._limits, ReplyLimits.of(settings))
        self._prefills = prefills if prefills.max_wait > 0 else None
        self._max_attempts = settings.max_attempts
        self._backoff = settings.retry_backoff
        self._retry_after_cap = settings.retry_after_cap
        self._observe_usage = settings.observe_usage
        self._forward_priority = settings.forward_priority
        self._speed = speed
        self._rng = rng or random.Random()

    async def forward(self, forwarding: Forwarding) -> Outcome:
        """Forward the request to its placement's replica, and to the next ones after a
        failure before the first byte; what came of it, whatever happened."""
        request = forwarding.placement.request
        if (
            (self._observe_usage or forwarding.needs_usage)
            and request.stream
            and not request.wants_usage
            and request.endpoint in _USAGE_ASKED
        ):
            forwarding.strip_usage = True
            forwarding.body = request_usage(forwarding.body)
        # A stored response's `cancel` computes nothing: its body (usually none) goes as sent.
        salted = request.endpoint.salted and request.response_id is None
        if request.tenant is not None and salted and forwarding.method == b"POST":
            forwarding.body = with_cache_salt(forwarding.body, request.tenant)
        if self._forward_priority:
            _prioritise(forwarding)
        tries = _Tries(forwarding)
        exchange = forwarding.exchange
        try:
            with exchange.guard():
                relayed = await self._attempts(tries)
        except Interrupted as stop:
            relayed = Relayed(await self._cut_short(stop.why, tries))
        except asyncio.CancelledError:
            # The server's own, at the end of its shutdown grace: answer what can be answered.
            relayed = Relayed(await self._cut_short(None, tries))
        finally:
            exchange.finish()
        return forwarding.outcome(relayed.status)

    async def _attempts(self, tries: _Tries) -> Relayed:
        forwarding = tries.forwarding
        placement, exchange = forwarding.placement, forwarding.exchange
        backend = placement.backend
        # The first attempt adopts the slot its placement took; a retry takes its own.
        slot = placement.slot if placement.slot is not None else Lease(backend)
        fleet = placement.fleet
        pause = 0.0
        while True:
            if pause > 0:
                await asyncio.sleep(pause)
            with Attempt(
                slot,
                forwarding.decision,
                placement.chain,
                self._prefills,
                placement.request.stream,
                exchange,
                self._speed,
                placement.shared,
                fleet.computing if fleet is not None else frozenset(),
            ) as attempt:
                await attempt.take_turn()
                exchange.expect(Why.FIRST_BYTE, self._limits.first_byte)
                attempt.sent()
                try:
                    with exchange.guard():
                        response = await self.upstream.send(
                            backend.url + forwarding.path,
                            forwarding.body,
                            forwarding.headers,
                            backend.credentialed,
                            forwarding.method,
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
                        relayed, retry = await self._answer(attempt, tries, response)
                    finally:
                        # Closes the connection unless the response was read to its end: a
                        # replica whose client left sees its request aborted at once.
                        response.release()
                forwarding.first_byte_at = attempt.first_byte_at
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
                error = failed.error
                if failed.cause == "connect":
                    # Nothing could take it: answered as when no replica is healthy at all.
                    error = refused("no_healthy_backend", placement.request.model)
                headers = forwarding.gateway_headers(forwarding.decision)
                await forwarding.reply.fail(error, headers)
                return Relayed(error.status, failure=failed)
            backend, pause = moved
            slot = Lease(backend)

    async def _answer(
        self, attempt: Attempt, tries: _Tries, response: Response
    ) -> tuple[Relayed, tuple[str, float | None] | None]:
        """Relay `response`, unless its status asks for another replica and one is left: then
        `Relayed(0)`, the retry's cause and its pause."""
        backend = attempt.backend
        status = response.status
        # A non-streamed 200 counts as a success once its body turned out to be JSON.
        whole = status == 200 and not tries.forwarding.placement.request.stream
        if status >= 500:
            self._failed(backend, f"status_{status}")
        else:
            if status < 300:
                tries.accepted.append(backend.name)
            if not whole:
                self._health.request_succeeded(backend)
        if status in _RETRY_STATUSES:
            after = _retry_after(response.headers.get("retry-after")) if status == 429 else None
            if (after is None or after <= self._retry_after_cap) and self._can_move(tries):
                return Relayed(0), (f"status_{status}", after)
        forwarding = tries.forwarding
        out_headers = response_headers(response.raw_headers)
        out_headers.extend(forwarding.gateway_headers(forwarding.decision))
        relayed = await self._relay(forwarding, attempt, response, out_headers)
        if whole and relayed.failure is None:
            self._health.request_succeeded(backend)
        return relayed, None

    def _can_move(self, tries: _Tries) -> bool:
        if len(tries.tried) >= self._max_attempts:
            return False
        tries.upcoming = tries.forwarding.placement.next_after(tries.tried)
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
        tries.forwarding.decision = decision
        tries.tried.append(backend.name)
        return backend, pause

    def _failed(self, backend: Backend, cause: str, blame: bool = True) -> None:
        self._metrics.upstream_errors.labels(backend.name, cause).inc()
        if blame:
            self._health.request_failed(backend, cause)

    async def _cut_short(self, why: Why | None, tries: _Tries) -> int:
        """Finish a request interrupted by its client, a deadline or the server's shutdown."""
        forwarding = tries.forwarding
        limits = self._limits
        error = client_error(why, limits.idle if why is Why.IDLE else limits.total)
        if error is None:
            self._metrics.client_disconnects.labels(forwarding.placement.request.model).inc()
            return 499
        if forwarding.exchange.done and forwarding.reply.begun:
            return error.status  # its last bytes are on their way
        with contextlib.suppress(Exception):  # the connection may be gone already
            await forwarding.reply.fail(error, forwarding.gateway_headers(forwarding.decision))
        return error.status


class _Tries:
    """The attempts so far, kept on the forwarding (which outlives a failure here): every
    backend tried and those that accepted the request; and the next backend chosen."""

    __slots__ = ("accepted", "forwarding", "tried", "upcoming")

    def __init__(self, forwarding: Forwarding) -> None:
        placement = forwarding.placement
        self.forwarding = forwarding
        self.tried = forwarding.tried
        self.tried.append(placement.backend.name)
        self.accepted = forwarding.accepted
        self.upcoming: tuple[Backend, Decision] | None = None


def _prioritise(forwarding: Forwarding) -> None:
    """The tenant's priority in vLLM's terms (lower is served first) in place of whatever the
    client asked for, in its body or its header: a client cannot raise its own."""
    forwarding.headers = [item for item in forwarding.headers if item[0] != _ENGINE_PRIORITY_HEADER]
    request = forwarding.placement.request
    if request.endpoint is Endpoint.MESSAGES:
        priority = str(-forwarding.tenant_priority).encode()
        forwarding.headers = [*forwarding.headers, (_ENGINE_PRIORITY_HEADER, priority)]
    elif (
        request.endpoint in _PRIORITISED
        and request.response_id is None
        and forwarding.method == b"POST"
    ):
        forwarding.body = with_priority(forwarding.body, -forwarding.tenant_priority)


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
