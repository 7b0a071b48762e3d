"""The proxy path: one lean ASGI handler for the OpenAI inference endpoints.

Admit (a bounded number at once, a bounded queue), read the body (bounded), parse once, route,
forward the original bytes, relay the response as it arrives, then tell the router what came
back.

Failures before the first byte has gone to the client move the request to the next candidate
(`--max-attempts` in all, with jittered exponential backoff): connection errors, a replica
that sends nothing in time, a response that breaks off before its first byte, 502/503/504, and
429 (after its `Retry-After`, when that is short enough). A stream that breaks after its first
byte ends with an SSE error event. A client that hangs up cancels the upstream request at once,
so the engine stops generating. Every outcome is counted; in-flight counts and the admission
slot are released on every path.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import math
import os
import random
import time
import uuid
from email.utils import parsedate_to_datetime

from gateway.backends.health import Health
from gateway.backends.pool import Backend
from gateway.errors import (
    GatewayError,
    Overloaded,
    RequestTimeout,
    ShuttingDown,
    UpstreamTimeout,
    sse_error,
)
from gateway.metrics import Metrics
from gateway.prompt.parsing import ENDPOINTS, Endpoint, parse_request
from gateway.proxy.access_log import AccessLog
from gateway.proxy.admission import Admission
from gateway.proxy.asgi import Receive, Scope, Send, check_json_depth, header, read_body, send_error
from gateway.proxy.deadlines import (
    BODY,
    CLIENT_STALLED,
    DISCONNECTED,
    FIRST_BYTE,
    TOTAL,
    DeadlineWatch,
    Exchange,
)
from gateway.proxy.prefill_waits import Prefills
from gateway.proxy.relay import BeforeFirstByte, Relay, first_byte_missed, stream_timeout
from gateway.proxy.upstream import Upstream, UpstreamError, UpstreamResponse, response_headers
from gateway.proxy.usage import Observation, request_usage
from gateway.routing.feedback import CacheFeedback
from gateway.routing.router import RoutedRequest, Router

log = logging.getLogger("gateway.proxy.handler")

_RETRY_STATUSES = frozenset({429, 502, 503, 504})
_RETRY_AFTER = (b"retry-after", b"1")


class RequestIds:
    """Request ids unique across processes and restarts: a random prefix and a counter.

    A quarter of the cost of a uuid4 on every request, and as unique for this purpose.
    """

    def __init__(self) -> None:
        self._prefix = os.urandom(8).hex()
        self._count = itertools.count()

    def next(self) -> str:
        return f"{self._prefix}{next(self._count):016x}"


class ProxyHandler:
    def __init__(
        self,
        router: Router,
        upstream: Upstream,
        metrics: Metrics,
        health: Health,
        admission: Admission,
        rng: random.Random | None = None,
    ) -> None:
        self.router = router
        self.upstream = upstream
        self.metrics = metrics
        self.health = health
        self.admission = admission
        self.settings = settings = router.settings
        self.access_log = AccessLog(settings)
        self._rng = rng or random.Random()
        self._first_byte_timeout = settings.first_byte_timeout
        self._idle_timeout = settings.stream_idle_timeout
        self._request_timeout = settings.request_timeout
        self.deadlines = DeadlineWatch(
            min(self._first_byte_timeout, self._idle_timeout, self._request_timeout)
        )
        self._relay = Relay(metrics, self._first_byte_timeout, self._idle_timeout, self._failed)
        self._observe_usage = settings.observe_usage
        self.feedback = (
            CacheFeedback(router.index, metrics, settings) if settings.cache_feedback else None
        )
        self._request_ids = RequestIds()
        self.prefills = Prefills(settings.prefill_wait, metrics)

    def start(self) -> None:
        self.deadlines.start()

    async def stop(self) -> None:
        await self.deadlines.stop()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        request_id = header(headers, b"x-request-id") or self._request_ids.next()
        admission = self.admission
        if not admission.try_enter():
            refused = await admission.enter()
            if refused is not None:
                error = Overloaded(
                    "the gateway is at its concurrency limit and its queue is full; retry later"
                    if refused == "overloaded"
                    else "no capacity was freed in time; retry later",
                    code=refused,
                )
                await self._reject(scope, request_id, error, send, [_RETRY_AFTER])
                return
        task = asyncio.current_task()
        assert task is not None
        exchange = Exchange(task, time.monotonic(), self._request_timeout)
        self.deadlines.add(exchange)
        try:
            await self._handle(scope, receive, send, headers, request_id, exchange)
        except asyncio.CancelledError:
            # The server cancels what still runs when its shutdown grace ends. The task is
            # ending anyway: answer what can be answered and end it without an error.
            if exchange.reason is not None:
                raise
            if not exchange.begun:
                ending = ShuttingDown("the gateway is shutting down", code="shutting_down")
                with contextlib.suppress(Exception):
                    await send_error(send, ending, [(b"x-request-id", request_id.encode())])
        finally:
            exchange.done = True
            self.deadlines.discard(exchange)
            admission.leave()

    async def _handle(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        headers: list[tuple[bytes, bytes]],
        request_id: str,
        exchange: Exchange,
    ) -> None:
        settings = self.settings
        try:
            try:
                exchange.expect(BODY, self._idle_timeout)
                body = await read_body(receive, settings.max_body_bytes)
            except asyncio.CancelledError:
                if exchange.reason != BODY:
                    raise
                exchange.resume()
                raise RequestTimeout(
                    "the request body did not arrive in time", code="body_timeout"
                ) from None
            exchange.due = exchange.deadline
            cookie = settings.sticky_cookie
            session_header = header(headers, b"x-session-id")
            if cookie and session_header is None:
                session_header = _cookie_value(headers, cookie)
            request = parse_request(
                ENDPOINTS[scope["path"]],
                body,
                session_header,
                settings.default_model,
                settings.session_from_user,
            )
            check_json_depth(body, settings.max_json_depth)
            issued = None
            if cookie and request.session_key is None:
                issued = uuid.uuid4().hex
                request = dataclasses.replace(request, session_key=issued)
            routed = await self.router.route(request)
            routed.issued_session = issued
        except GatewayError as error:
            await self._reject(scope, request_id, error, send)
            return
        await self._forward(routed, body, headers, request_id, exchange, receive, send)

    async def _reject(
        self,
        scope: Scope,
        request_id: str,
        error: GatewayError,
        send: Send,
        extra: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        self.metrics.rejected.labels(str(error.status), error.code or error.error_type).inc()
        self.access_log.rejected(request_id, scope["path"], error)
        await send_error(send, error, [(b"x-request-id", request_id.encode()), *(extra or [])])

    async def _forward(
        self,
        routed: RoutedRequest,
        body: bytes,
        headers: list[tuple[bytes, bytes]],
        request_id: str,
        exchange: Exchange,
        receive: Receive,
        send: Send,
    ) -> None:
        outgoing = [item for item in headers if item[0] != b"x-request-id"]
        outgoing.append((b"x-request-id", request_id.encode()))
        request = routed.input
        strip_usage = (
            self._observe_usage
            and request.stream
            and not request.wants_usage
            and request.endpoint is not Endpoint.EMBEDDINGS
        )
        if strip_usage:
            body = request_usage(body)
        watcher = asyncio.create_task(exchange.watch_client(receive))
        status = 0
        began = time.perf_counter()
        seen: Observation | None = None
        try:
            prefills = self.prefills
            earlier = prefills.earlier(routed)
            if earlier is not None:
                with self.router.pool.lease(routed.backend):
                    # Counted in its backend's load meanwhile, so the bound sees who waits.
                    await prefills.wait(earlier)
            computing = prefills.begin(routed)
            try:
                status, seen = await self._attempts(
                    routed, body, outgoing, request_id, exchange, send, strip_usage
                )
            finally:
                prefills.end(computing)
        except asyncio.CancelledError:
            reason = exchange.reason
            if reason is not None:
                exchange.resume()
            # A cancellation with no reason is the server's, at the end of its shutdown grace.
            status = await self._cut_short(routed, exchange, request_id, send, reason)
        finally:
            exchange.done = True
            routed.prefill_done()
            watcher.cancel()
            self.metrics.child(
                self.metrics.requests,
                routed.input.model,
                routed.backend.name,
                routed.route.value,
                str(status),
            ).inc()
            self.access_log.answered(routed, status, seen, request_id, began)
        if status == 200 and seen is not None:
            await self._learn(routed, seen)

    async def _attempts(
        self,
        routed: RoutedRequest,
        body: bytes,
        outgoing: list[tuple[bytes, bytes]],
        request_id: str,
        exchange: Exchange,
        send: Send,
        strip_usage: bool,
    ) -> tuple[int, Observation | None]:
        """Try candidates until one answers or a failure has to be the answer."""
        path = routed.input.endpoint.value
        pause = 0.0
        while True:
            if pause > 0:
                await asyncio.sleep(pause)
            backend = routed.backend
            with self.router.pool.lease(backend):
                exchange.expect(FIRST_BYTE, self._first_byte_timeout)
                started = time.perf_counter()
                try:
                    response = await self._send(exchange, backend.url + path, body, outgoing)
                except UpstreamError as failure:
                    retry = await self._failed_attempt(routed, failure)
                    if retry is not None:
                        pause = retry
                        continue
                    return await self._fail(routed, exchange, request_id, failure.error, send)
                try:
                    status = response.status
                    if status >= 500:
                        self._failed(backend, f"status_{status}")
                    elif backend.failures:
                        backend.failures = 0
                    if status in _RETRY_STATUSES:
                        retry = await self._retry(routed, f"status_{status}", response)
                        if retry is not None:
                            pause = retry
                            continue
                    out_headers = response_headers(response.raw_headers)
                    out_headers.extend(self._gateway_headers(routed, request_id))
                    try:
                        return await self._relay(
                            routed, exchange, response, out_headers, started, send, strip_usage
                        )
                    except BeforeFirstByte as early:
                        retry = await self._failed_attempt(routed, early.failure)
                        if retry is not None:
                            pause = retry
                            continue
                        error = early.failure.error
                        return await self._fail(routed, exchange, request_id, error, send)
                finally:
                    # Closes the connection unless the response was read to its end: a replica
                    # whose client left sees its request aborted at once.
                    response.release()

    async def _send(
        self, exchange: Exchange, url: str, body: bytes, outgoing: list[tuple[bytes, bytes]]
    ) -> UpstreamResponse:
        try:
            return await self.upstream.send(url, body, outgoing)
        except asyncio.CancelledError:
            missed = first_byte_missed(exchange, self._first_byte_timeout)
            if missed is None:
                raise
            raise missed from None

    async def _failed_attempt(self, routed: RoutedRequest, failure: UpstreamError) -> float | None:
        self._failed(routed.backend, failure.cause)
        return await self._retry(routed, failure.cause)

    async def _retry(
        self, routed: RoutedRequest, cause: str, response: UpstreamResponse | None = None
    ) -> float | None:
        """The pause before trying the next candidate, or None when this failure is the answer."""
        settings = self.settings
        attempt = len(routed.tried)
        if attempt >= settings.max_attempts:
            return None
        pause = settings.retry_backoff * 2.0 ** (attempt - 1) * self._rng.random()
        if response is not None and response.status == 429:
            after = _retry_after(response.headers.get("retry-after"))
            if after is not None:
                if after > settings.retry_after_cap:
                    return None
                pause = max(pause, after)
        if not await self.router.reroute(routed):
            return None
        self.metrics.retries.labels(cause).inc()
        return pause

    def _failed(self, backend: Backend, cause: str, blame: bool = True) -> None:
        self.metrics.upstream_errors.labels(backend.name, cause).inc()
        if blame:
            self.health.request_failed(backend, cause)

    async def _fail(
        self,
        routed: RoutedRequest,
        exchange: Exchange,
        request_id: str,
        error: GatewayError,
        send: Send,
    ) -> tuple[int, None]:
        exchange.done = True
        exchange.begun = True
        await send_error(send, error, self._gateway_headers(routed, request_id))
        return error.status, None

    async def _cut_short(
        self,
        routed: RoutedRequest,
        exchange: Exchange,
        request_id: str,
        send: Send,
        reason: str | None,
    ) -> int:
        """Finish a request interrupted by its client, a deadline or the server's shutdown."""
        completing = exchange.done and exchange.begun  # its last bytes are on their way
        exchange.done = True
        if reason in (DISCONNECTED, CLIENT_STALLED):
            self.metrics.client_disconnects.labels(routed.input.model).inc()
            return 499
        error: GatewayError
        if reason is None:
            error = ShuttingDown("the gateway is shutting down", code="shutting_down")
        elif reason == TOTAL:
            error = stream_timeout(TOTAL, self._request_timeout)[1]
        else:
            error = UpstreamTimeout("upstream timed out", code=f"{reason}_timeout")
        if completing or (exchange.begun and not exchange.streaming):
            return error.status
        try:
            if exchange.begun:
                await send({"type": "http.response.body", "body": b"\n\n" + sse_error(error)})
            else:
                exchange.begun = True
                await send_error(send, error, self._gateway_headers(routed, request_id))
        except Exception:  # the connection is already gone
            log.debug("could not tell the client why its request ended", exc_info=True)
        return error.status

    async def _learn(self, routed: RoutedRequest, seen: Observation) -> None:
        model = routed.input.model
        backend_name = routed.backend.name
        block_tokens = self.settings.block_tokens
        metrics = self.metrics
        metrics.child(metrics.prompt_tokens_estimated, model).inc(
            len(routed.input.canonical) / self.settings.chars_per_token
        )
        metrics.child(metrics.matched_tokens_predicted, model).inc(
            routed.decision.matched_blocks * block_tokens
        )
        if seen.prompt_tokens is not None:
            metrics.child(metrics.upstream_prompt_tokens, model, backend_name).inc(
                seen.prompt_tokens
            )
        if seen.cached_tokens is not None:
            metrics.child(metrics.upstream_cached_tokens, model, backend_name).inc(
                seen.cached_tokens
            )
        answered = self.router.answered(routed, seen.answer)
        if self.feedback is not None:
            # Before the answer is recorded: pruning looks at what was known before this request.
            await self.feedback.observe(routed, seen, answered.chain)
        await self.router.learn_answer(routed, answered)

    def _gateway_headers(self, routed: RoutedRequest, request_id: str) -> list[tuple[bytes, bytes]]:
        headers = [
            (b"x-gateway-backend", routed.backend.name.encode()),
            (b"x-gateway-route", routed.route.value.encode()),
            (b"x-request-id", request_id.encode()),
        ]
        if routed.issued_session is not None:
            # No Max-Age: the binding itself expires after the TTL of inactivity; a key sent
            # back after that simply binds again.
            cookie = f"{self.settings.sticky_cookie}={routed.issued_session}"
            headers.append((b"set-cookie", f"{cookie}; Path=/; HttpOnly; SameSite=Lax".encode()))
        return headers


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


def _cookie_value(headers: list[tuple[bytes, bytes]], name: str) -> str | None:
    """The value of cookie `name` in the request's Cookie headers."""
    for key, value in headers:
        if key == b"cookie":
            for pair in value.decode("latin-1").split(";"):
                cookie, _, content = pair.strip().partition("=")
                if cookie == name and content:
                    return content
    return None
