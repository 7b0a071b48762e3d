"""The proxy path: one lean ASGI handler for the OpenAI inference endpoints.

Read the body (bounded), parse once, route, forward the original bytes, relay the response as
it arrives, then tell the router what came back. Failover happens only before the first byte
has gone to the client. A client that hangs up cancels the upstream request, so the engine
stops generating.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid

import aiohttp

from gateway.access_log import AccessLog
from gateway.asgi import Receive, Scope, Send, header, read_body, send_error
from gateway.errors import GatewayError
from gateway.metrics import Metrics
from gateway.observe import Observation, StreamObserver, observe_body
from gateway.parsing import ENDPOINTS, parse_request
from gateway.router import RoutedRequest, Router
from gateway.upstream import Upstream, UpstreamError, response_headers

log = logging.getLogger("gateway.proxy")

_RETRY_STATUSES = frozenset({502, 503, 504})


class ProxyHandler:
    def __init__(self, router: Router, upstream: Upstream, metrics: Metrics) -> None:
        self.router = router
        self.upstream = upstream
        self.metrics = metrics
        self.settings = router.settings
        self.access_log = AccessLog(router.settings)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        request_id = header(headers, b"x-request-id") or uuid.uuid4().hex
        try:
            body = await read_body(receive, self.settings.max_body_bytes)
            cookie = self.settings.sticky_cookie
            session_header = header(headers, b"x-session-id")
            if cookie and session_header is None:
                session_header = _cookie_value(headers, cookie)
            request = parse_request(
                ENDPOINTS[scope["path"]],
                body,
                session_header,
                self.settings.default_model,
                self.settings.session_from_user,
            )
            issued = None
            if cookie and request.session_key is None:
                issued = uuid.uuid4().hex
                request = dataclasses.replace(request, session_key=issued)
            routed = await self.router.route(request)
            routed.issued_session = issued
        except GatewayError as error:
            self.metrics.rejected.labels(str(error.status), error.code or error.error_type).inc()
            self.access_log.rejected(request_id, scope["path"], error)
            await send_error(send, error, [(b"x-request-id", request_id.encode())])
            return
        await self._forward(routed, body, headers, request_id, receive, send)

    async def _forward(
        self,
        routed: RoutedRequest,
        body: bytes,
        headers: list[tuple[bytes, bytes]],
        request_id: str,
        receive: Receive,
        send: Send,
    ) -> None:
        path = routed.input.endpoint.value
        outgoing = [item for item in headers if item[0] != b"x-request-id"]
        outgoing.append((b"x-request-id", request_id.encode()))
        finished = False
        disconnected = False
        relay_task = asyncio.current_task()

        async def watch_disconnect() -> None:
            nonlocal disconnected
            message = await receive()
            if message["type"] == "http.disconnect" and not finished and relay_task is not None:
                disconnected = True
                relay_task.cancel()

        watcher = asyncio.create_task(watch_disconnect())
        status = 0
        began = time.perf_counter()
        seen: Observation | None = None
        try:
            while True:
                backend = routed.backend
                with self.router.pool.lease(backend):
                    started = time.perf_counter()
                    try:
                        response = await self.upstream.send(backend.url + path, body, outgoing)
                    except UpstreamError as failure:
                        self._count_failure(routed, failure.cause)
                        if await self._may_retry(routed, failure.cause):
                            continue
                        status = failure.error.status
                        await send_error(
                            send, failure.error, self._gateway_headers(routed, request_id)
                        )
                        return
                    if response.status in _RETRY_STATUSES and await self._may_retry(
                        routed, f"status_{response.status}"
                    ):
                        response.release()
                        continue
                    status = response.status
                    try:
                        seen = await self._relay(routed, response, request_id, started, send)
                    finally:
                        finished = True
                        response.release()
                break
            await self._learn(routed, status, seen)
        except asyncio.CancelledError:
            if not disconnected:
                raise
            status = 499
            self.metrics.client_disconnects.labels(routed.input.model).inc()
        finally:
            finished = True
            watcher.cancel()
            self.metrics.requests.labels(
                routed.input.model, routed.backend.name, routed.route.value, str(status)
            ).inc()
            self.access_log.answered(routed, status, seen, request_id, began)

    async def _relay(
        self,
        routed: RoutedRequest,
        response: aiohttp.ClientResponse,
        request_id: str,
        started: float,
        send: Send,
    ) -> Observation:
        out_headers = response_headers(response.raw_headers)
        out_headers.extend(self._gateway_headers(routed, request_id))
        backend_name = routed.backend.name
        streaming = routed.input.stream and response.status == 200
        if not streaming:
            payload = await response.read()
            routed.first_byte_at = time.perf_counter()
            self.metrics.first_byte_seconds.labels(backend_name).observe(
                routed.first_byte_at - started
            )
            out_headers.append((b"content-length", str(len(payload)).encode()))
            await send(
                {"type": "http.response.start", "status": response.status, "headers": out_headers}
            )
            await send({"type": "http.response.body", "body": payload})
            self.metrics.duration_seconds.labels(backend_name).observe(
                time.perf_counter() - started
            )
            return observe_body(payload) if response.status == 200 else Observation()

        await send(
            {"type": "http.response.start", "status": response.status, "headers": out_headers}
        )
        observer = StreamObserver()
        first = True
        async for chunk in response.content.iter_any():
            if first:
                routed.first_byte_at = time.perf_counter()
                self.metrics.first_byte_seconds.labels(backend_name).observe(
                    routed.first_byte_at - started
                )
                first = False
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            observer.feed(chunk)
        await send({"type": "http.response.body", "body": b""})
        self.metrics.duration_seconds.labels(backend_name).observe(time.perf_counter() - started)
        return observer.seen

    async def _may_retry(self, routed: RoutedRequest, cause: str) -> bool:
        if len(routed.tried) >= self.settings.max_attempts:
            return False
        if not await self.router.reroute(routed):
            return False
        self.metrics.retries.labels(cause).inc()
        return True

    def _count_failure(self, routed: RoutedRequest, cause: str) -> None:
        self.metrics.upstream_errors.labels(routed.backend.name, cause).inc()
        if cause == "connect":
            self.router.pool.set_health(routed.backend, False)

    async def _learn(self, routed: RoutedRequest, status: int, seen: Observation) -> None:
        if status != 200:
            return
        model = routed.input.model
        backend_name = routed.backend.name
        block_tokens = self.settings.block_tokens
        self.metrics.prompt_tokens_estimated.labels(model).inc(
            len(routed.input.canonical) / self.settings.chars_per_token
        )
        self.metrics.matched_tokens_predicted.labels(model).inc(
            routed.decision.matched_blocks * block_tokens
        )
        if seen.prompt_tokens is not None:
            self.metrics.upstream_prompt_tokens.labels(model, backend_name).inc(seen.prompt_tokens)
        if seen.cached_tokens is not None:
            self.metrics.upstream_cached_tokens.labels(model, backend_name).inc(seen.cached_tokens)
        await self.router.learn_answer(routed, seen.answer)

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


def _cookie_value(headers: list[tuple[bytes, bytes]], name: str) -> str | None:
    """The value of cookie `name` in the request's Cookie headers."""
    for key, value in headers:
        if key == b"cookie":
            for pair in value.decode("latin-1").split(";"):
                cookie, _, content = pair.strip().partition("=")
                if cookie == name and content:
                    return content
    return None
