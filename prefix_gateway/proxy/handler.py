"""The proxy path: one lean ASGI handler for the OpenAI inference endpoints and the Responses
API's stored responses, which takes a request one way through (docs/architecture.md). The body
is read before admission, so that a slow client holds no slot; a client's `x-request-id` is
used only if it is a short token.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import os
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from prefix_gateway.auth import KEY_POSITION, TENANT
from prefix_gateway.config import Settings
from prefix_gateway.errors import GatewayError, error_shape
from prefix_gateway.metrics import Metrics
from prefix_gateway.prompt.parsing import (
    ENDPOINTS,
    BodyLimits,
    RoutingInput,
    parse_request,
    session_hash,
    stored_response_request,
)
from prefix_gateway.prompt.responses_api import response_target
from prefix_gateway.proxy.access_log import AccessLog
from prefix_gateway.proxy.admission import Admission, PendingBodies
from prefix_gateway.proxy.asgi import (
    Receive,
    Scope,
    Send,
    header,
    read_body,
    too_many_pending_bodies,
)
from prefix_gateway.proxy.deadlines import (
    CLIENT_CONNECTION,
    ClientConnection,
    DeadlineWatch,
    Exchange,
    Interrupted,
    Why,
    client_error,
)
from prefix_gateway.proxy.flow import Flow
from prefix_gateway.proxy.forwarder import Forwarder
from prefix_gateway.proxy.forwarding import Forwarding
from prefix_gateway.proxy.reply import Headers, Reply
from prefix_gateway.refusals import refused
from prefix_gateway.routing.placement import Placement
from prefix_gateway.routing.router import Router
from prefix_gateway.routing.types import Decision, Outcome
from prefix_gateway.tenants.gate import TenantGate
from prefix_gateway.tenants.tenant import Charge, Tenant

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_TOKENIZED_BESIDE_THE_LOOP = 4096
"""Body bytes from which, with `--tokenizer`, a request is parsed on the tokenizing thread: a
prompt never seen before costs about a millisecond per thousand tokens to encode, which the
event loop would otherwise spend not relaying anything else (the hop costs tens of µs)."""


class RequestIds:
    """Request ids unique across processes and restarts: a random prefix and a counter."""

    def __init__(self) -> None:
        self._prefix = os.urandom(8).hex()
        self._count = itertools.count()

    def next(self) -> str:
        return f"{self._prefix}{next(self._count):016x}"


class ProxyHandler:
    def __init__(
        self,
        settings: Settings,
        router: Router,
        forwarder: Forwarder,
        admission: Admission,
        metrics: Metrics,
        tenants: TenantGate | None = None,
        flow: Flow | None = None,
    ) -> None:
        self._settings = settings
        self._tenants = tenants
        self._flow = flow
        self._router = router
        self._forwarder = forwarder
        self._admission = admission
        self._metrics = metrics
        self._access_log = AccessLog(settings)
        self._request_ids = RequestIds()
        self._limits = BodyLimits.of(settings)
        self._pending = PendingBodies(settings.max_pending_body_bytes)
        self._tokenizing = (
            None
            if router.tokenizer is None
            else ThreadPoolExecutor(1, thread_name_prefix="gateway-tokenize")
        )
        self.deadlines = DeadlineWatch(
            min(
                settings.body_timeout,
                settings.first_byte_timeout,
                settings.stream_idle_timeout,
                settings.client_write_timeout,
                settings.request_timeout,
            )
        )

    def start(self) -> None:
        self.deadlines.start()
        if self._flow is not None:
            self._flow.start()

    async def stop(self) -> None:
        if self._flow is not None:
            await self._flow.stop()
        await self.deadlines.stop()
        if self._tokenizing is not None:
            self._tokenizing.shutdown(wait=False, cancel_futures=True)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        request_id = _client_request_id(headers) or self._request_ids.next()
        connection = scope.get(CLIENT_CONNECTION)
        reply = Reply(send, self._metrics, connection, error_shape(scope["path"]))
        task = asyncio.current_task()
        assert task is not None
        exchange = Exchange(task, time.monotonic(), self._settings.request_timeout)
        self.deadlines.add(exchange)
        pending = 0  # bytes of this request's body still counted against the pending budget
        admission = self._admission
        admitted = False
        try:
            with exchange.guard():
                try:
                    body = await self._read_body(headers, receive, exchange)
                except GatewayError as unread:
                    await self._reject(scope, request_id, unread, reply)
                    return
                pending = len(body)
                if not admission.try_enter():
                    cause = await admission.enter()
                    if cause is not None:
                        await self._reject(scope, request_id, refused(cause), reply)
                        return
                admitted = True
                self._pending.release(pending)
                pending = 0
                await self._handle(scope, receive, headers, body, request_id, exchange, reply)
        except Interrupted as stop:  # its time ran out before it was forwarded
            late = client_error(stop.why, self._settings.request_timeout)
            if late is not None:
                await self._reject(scope, request_id, late, reply)
        except asyncio.CancelledError:
            # The server cancels what still runs when its shutdown grace ends. The task is
            # ending anyway: answer what can be answered and end it without an error.
            if not reply.begun:
                ending = refused("shutting_down")
                with contextlib.suppress(Exception):
                    await reply.fail(ending, [(b"x-request-id", request_id.encode())])
        finally:
            exchange.finish()
            self.deadlines.discard(exchange)
            if admitted:
                admission.leave()
            self._pending.release(pending)

    async def _read_body(
        self, headers: list[tuple[bytes, bytes]], receive: Receive, exchange: Exchange
    ) -> bytes:
        """The whole body within `--body-timeout`; one declared too large is refused unread."""
        settings = self._settings
        declared = header(headers, b"content-length")
        if declared is not None:
            try:
                length = int(declared)
            except ValueError:
                raise refused("invalid_http", message="invalid content-length") from None
            if length > settings.max_body_bytes:
                raise refused("body_too_large", settings.max_body_bytes)
            if not self._pending.fits(length):
                raise too_many_pending_bodies()
        exchange.expect(Why.BODY, settings.body_timeout)
        try:
            with exchange.guard():
                body = await read_body(receive, settings.max_body_bytes, self._pending)
        except Interrupted as stop:
            late = client_error(stop.why, settings.body_timeout)
            if stop.why is not Why.BODY or late is None:
                raise
            raise late from None
        exchange.due = exchange.deadline
        return body

    async def _handle(
        self,
        scope: Scope,
        receive: Receive,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        request_id: str,
        exchange: Exchange,
        reply: Reply,
    ) -> None:
        path: str = scope["path"]
        tenant = scope.get(TENANT)
        issued = None
        gate = self._tenants
        named = None if gate is None else gate.of_key(scope.get(KEY_POSITION, -1))
        charge: Charge | None = None
        try:
            target = response_target(path)
            if target is not None:
                query: bytes = scope.get("query_string", b"")
                request = stored_response_request(target[0], query, tenant, body, self._limits)
                path += "?" + query.decode("latin-1") if query else ""
            elif self._tokenizing is not None and len(body) >= _TOKENIZED_BESIDE_THE_LOOP:
                # The encode releases the GIL: other streams go on while it runs.
                request, issued = await asyncio.get_running_loop().run_in_executor(
                    self._tokenizing, self._parse, path, headers, body, tenant
                )
            else:
                request, issued = self._parse(path, headers, body, tenant)
            if gate is not None:
                charge = await gate.admit(named, request)
            if self._flow is None:
                placement = await self._router.route(request)
            else:
                placement = await self._place(self._flow, named, request)
        except GatewayError as error:
            if gate is not None:
                gate.release(charge, error.status)
            await self._reject(scope, request_id, error, reply)
            return
        connection = scope.get(CLIENT_CONNECTION)
        client = scope.get("client")
        peer = connection.peer if connection is not None else client[0] if client else None
        outgoing = self._forwarder.upstream.headers_for(
            headers, request_id.encode(), peer, scope.get("scheme", "http")
        )
        forwarding = Forwarding(
            placement,
            body,
            outgoing,
            exchange,
            reply,
            lambda decision: self._gateway_headers(decision, request_id, issued, charge),
            scope["method"].encode(),
            path,
            tenant_priority=0 if charge is None else charge.tenant.spec.priority,
        )
        began = time.perf_counter()
        if gate is None and self._flow is None:
            outcome = await self._forward(connection, receive, exchange, forwarding)
        else:
            try:
                outcome = await self._forward(connection, receive, exchange, forwarding)
            except BaseException:
                self._ended(named, placement, charge, None)
                raise
            self._ended(named, placement, charge, outcome)
        self._access_log.answered(placement, outcome, request_id, began)
        await placement.settle(outcome)

    async def _place(self, flow: Flow, tenant: Tenant | None, request: RoutingInput) -> Placement:
        """Its placement under flow control, once a replica has a free slot for it (a request
        about a stored response goes to the replica that holds it at once)."""
        if request.response_id or request.previous_response_id:
            return await self._router.route(request)
        return await flow.place(tenant, request)

    def _ended(
        self,
        tenant: Tenant | None,
        placement: Placement,
        charge: Charge | None,
        outcome: Outcome | None,
    ) -> None:
        """What a forwarded request held is given back and charged as it used it."""
        usage = None if self._tenants is None else self._tenants.settle(charge, outcome)
        flow = self._flow
        if flow is not None and not placement.pinned:
            flow.ended(tenant, placement, usage)

    async def _forward(
        self,
        connection: ClientConnection | None,
        receive: Receive,
        exchange: Exchange,
        forwarding: Forwarding,
    ) -> Outcome:
        if connection is not None:
            connection.watch(exchange)
            return await self._forwarder.forward(forwarding)
        watcher = asyncio.create_task(exchange.watch_client(receive))
        try:
            return await self._forwarder.forward(forwarding)
        finally:
            watcher.cancel()

    def _parse(
        self, path: str, headers: list[tuple[bytes, bytes]], body: bytes, tenant: str | None
    ) -> tuple[RoutingInput, str | None]:
        """The request as routing sees it, and the session key minted for it, if one was."""
        settings = self._settings
        cookie = settings.sticky_cookie
        session_header = header(headers, b"x-session-id")
        if cookie and session_header is None:
            session_header = _cookie_value(headers, cookie)
        request = parse_request(
            ENDPOINTS[path],
            body,
            session_header,
            settings.default_model,
            settings.session_from_user,
            self._limits,
            tenant,
            self._router.tokenizer,
        )
        issued = None
        if cookie and request.session_key is None:
            issued = uuid.uuid4().hex
            request = dataclasses.replace(request, session_key=session_hash(issued, tenant))
        return request, issued

    async def _reject(
        self,
        scope: Scope,
        request_id: str,
        error: GatewayError,
        reply: Reply,
    ) -> None:
        self._access_log.rejected(request_id, scope["path"], error)
        gate = self._tenants
        if gate is not None:
            gate.refused(gate.of_key(scope.get(KEY_POSITION, -1)), error.status)
        await reply.fail(error, [(b"x-request-id", request_id.encode())])

    def _gateway_headers(
        self, decision: Decision, request_id: str, issued: str | None, charge: Charge | None
    ) -> Headers:
        headers = [
            (b"x-gateway-backend", decision.backend.encode()),
            (b"x-gateway-route", decision.route.value.encode()),
            (b"x-request-id", request_id.encode()),
        ]
        if issued is not None:
            # No Max-Age: the binding itself expires after the TTL of inactivity; a key sent
            # back after that simply binds again.
            cookie = f"{self._settings.sticky_cookie}={issued}"
            headers.append((b"set-cookie", f"{cookie}; Path=/; HttpOnly; SameSite=Lax".encode()))
        if charge is not None:
            headers += charge.tenant.headers(time.monotonic())
        return headers


def _client_request_id(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The client's `x-request-id` if it is a short token safe to log and forward, else None."""
    given = header(headers, b"x-request-id")
    if given is not None and _REQUEST_ID.fullmatch(given):
        return given
    return None


def _cookie_value(headers: list[tuple[bytes, bytes]], name: str) -> str | None:
    """The value of cookie `name` in the request's Cookie headers."""
    for key, value in headers:
        if key == b"cookie":
            for pair in value.decode("latin-1").split(";"):
                cookie, _, content = pair.strip().partition("=")
                if cookie == name and content:
                    return content
    return None
