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
from typing import Any

from prefix_gateway.backends.backend import Backend
from prefix_gateway.backends.health import Health
from prefix_gateway.backends.pool import Lease
from prefix_gateway.backends.prefill_speed import PrefillSpeed
from prefix_gateway.config import Settings
from prefix_gateway.config.tenants import ANONYMOUS
from prefix_gateway.metrics import Metrics
from prefix_gateway.prompt.parsing import ENGINE_FIELDS, Endpoint
from prefix_gateway.proxy.attempt import Attempt
from prefix_gateway.proxy.deadlines import Interrupted, Why, client_error
from prefix_gateway.proxy.forwarding import Forwarding
from prefix_gateway.proxy.http1 import Response
from prefix_gateway.proxy.prefills import Prefills
from prefix_gateway.proxy.relay import Relay, Relayed, ReplyLimits, Timeouts
from prefix_gateway.proxy.rewrite import edited
from prefix_gateway.proxy.upstream import (
    ENGINE_PRIORITY_HEADER,
    Upstream,
    UpstreamError,
    interrupted,
    response_headers,
)
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
        allowed = frozenset(settings.engine_control)
        self._client_priority = "priority" in allowed
        self._client_fields = allowed & set(ENGINE_FIELDS)
        self._owned_ids = bool(settings.tenants) or settings.isolate_tenants
        """Requests have owners: each one's `request_id` (which names a stored response in
        vLLM's one store) is made its owner's own."""
        self._speed = speed
        self._rng = rng or random.Random()

    async def forward(self, forwarding: Forwarding) -> Outcome:
        """Forward the request to its placement's replica, and to the next ones after a
        failure before the first byte; what came of it, whatever happened."""
        request = forwarding.placement.request
        usage = (
            (self._observe_usage or forwarding.needs_usage)
            and request.stream
            and not request.wants_usage
            and request.endpoint in _USAGE_ASKED
        )
        # A stored response's `cancel` computes nothing: its body (usually none) goes as sent.
        salted = (
            request.tenant is not None
            and request.endpoint.salted
            and request.response_id is None
            and forwarding.method == b"POST"
        )
        if usage or salted or request.engine_fields is not None or self._forward_priority:
            self._edit(forwarding, usage, salted)
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

    def _edit(self, forwarding: Forwarding, usage: bool, salted: bool) -> None:
        """The body's changes, made in one pass (`edited`): its stream asking for usage, its
        tenant's salt, and the engine's controls as the gateway decides them."""
        request = forwarding.placement.request
        setting: dict[str, Any] = {}
        dropping: list[str] = []
        if usage:
            forwarding.strip_usage = True
        if salted:
            assert request.tenant is not None
            setting["cache_salt"] = request.tenant
        if request.engine_fields is not None or self._forward_priority:
            self._engine_controls(forwarding, setting, dropping)
        if usage or setting or dropping:
            forwarding.body = edited(forwarding.body, setting, dropping, usage)

    def _engine_controls(
        self, forwarding: Forwarding, setting: dict[str, Any], dropping: list[str]
    ) -> None:
        """What the engine's own controls become (docs/endpoints.md): the priority the
        gateway decides, in the body or, for the Messages API, vLLM's header; a client's
        `request_id` made its owner's; `kv_transfer_params` dropped; each as the client sent
        it where `--engine-control` allows it."""
        request = forwarding.placement.request
        given = request.engine_fields or {}
        allowed = self._client_fields
        runs_model = (
            request.endpoint in _PRIORITISED
            and request.response_id is None
            and forwarding.method == b"POST"
        )
        if (not self._client_priority or self._forward_priority) and (
            runs_model or request.endpoint is Endpoint.MESSAGES
        ):
            priority = forwarding.own_priority
            if priority is None and self._forward_priority:
                priority = -forwarding.tenant_priority
            if request.endpoint is Endpoint.MESSAGES:
                # vLLM's Messages request has no such field (its body goes as sent), but the
                # chat path it hands the request to reads the header.
                if priority is not None:
                    forwarding.headers = [
                        *forwarding.headers,
                        (ENGINE_PRIORITY_HEADER, b"%d" % priority),
                    ]
            elif priority is not None:
                asked = given.get("priority")
                if type(asked) is not int or asked != priority:  # else the body stays as sent
                    setting["priority"] = priority
            elif "priority" in given:
                dropping.append("priority")
        if "kv_transfer_params" in given and "kv_transfer_params" not in allowed:
            dropping.append("kv_transfer_params")
        given_id = given.get("request_id")
        if "request_id" in given and "request_id" not in allowed and self._owned_ids:
            if isinstance(given_id, str):
                setting["request_id"] = f"{request.owner or ANONYMOUS}:{given_id}"
            else:
                dropping.append("request_id")

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
