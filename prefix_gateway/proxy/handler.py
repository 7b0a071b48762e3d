"""The proxy path: every inference request, whatever its endpoint, lives one life here
(docs/architecture.md, "A request's life"), in this order:

1. admission: its body read within its limits, its bytes counted from the first one
   (`--max-pending-body-bytes`); one of the slots for requests proxied at once
   (`--max-concurrency`); its tenant's place among that tenant's requests in flight and its
   reservation of tokens against the tenant's budgets; its turn in the fair queue (flow
   control, `--max-inflight-per-replica`);
2. placement: routing entered once (`Placing`): the replica, its slot there (the backend's own
   count), and what the decision recorded;
3. attempts: the body forwarded byte for byte, failing over before the first byte;
4. settlement: the placement settled with how the request ended (what it recorded withdrawn if
   it never reached its replica), the tenant charged for what it used, and everything it took
   given back.

`RequestLife` holds what a request takes, and `_end` gives it all back in one place, whatever
ended the request: an answer, a refusal, a deadline, a failure, the client's hang-up (noticed
wherever it waits from the end of its body on), or the server's shutdown. Its tenant's side is
its `Account` (`prefix_gateway.proxy.tenancy`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from typing import Any

from prefix_gateway.auth import KEY_POSITION, TENANT
from prefix_gateway.backends.pool import BackendPool
from prefix_gateway.config import Settings
from prefix_gateway.errors import GatewayError, error_shape
from prefix_gateway.metrics import Metrics
from prefix_gateway.prompt.parsing import RoutingInput
from prefix_gateway.proxy.access_log import AccessLog
from prefix_gateway.proxy.admission import Admission, BodyBytes
from prefix_gateway.proxy.asgi import Receive, Scope, Send
from prefix_gateway.proxy.deadlines import (
    CLIENT_CONNECTION,
    DeadlineWatch,
    Exchange,
    Interrupted,
    client_error,
)
from prefix_gateway.proxy.flow import Flow, Ticket
from prefix_gateway.proxy.forwarder import Forwarder
from prefix_gateway.proxy.forwarding import Forwarding
from prefix_gateway.proxy.intake import Intake
from prefix_gateway.proxy.public_names import PublicNames
from prefix_gateway.proxy.reply import Headers, Reply
from prefix_gateway.proxy.tenancy import Account, Tenancy, TenantFleet
from prefix_gateway.refusals import refused
from prefix_gateway.routing.placement import Placement
from prefix_gateway.routing.router import Placing, Router
from prefix_gateway.routing.types import Decision, Outcome

log = logging.getLogger("prefix_gateway.proxy")


class ProxyHandler:
    """What every request's life shares, built once per process; the ASGI entry of the proxy
    path."""

    def __init__(
        self,
        settings: Settings,
        router: Router,
        forwarder: Forwarder,
        metrics: Metrics,
        pool: BackendPool,
        tenant_fleet: TenantFleet | None = None,
    ) -> None:
        self.settings = settings
        self.router = router
        self.forwarder = forwarder
        self.metrics = metrics
        self.pool = pool
        self.intake = Intake(settings, router.tokenizer)
        self.admission = Admission(
            settings.max_concurrency, settings.max_queue, settings.queue_timeout
        )
        self.bodies = BodyBytes(settings.max_pending_body_bytes)
        self.flow = Flow(settings, pool, metrics) if settings.max_inflight_per_replica else None
        self.tenancy = (
            Tenancy(settings, metrics, pool, tenant_fleet)
            if settings.tenants or self.flow is not None
            else None
        )
        self.access_log = AccessLog(settings)
        self.public_names = PublicNames(settings.backend_header)
        self.open_placements = 0
        """Requests placed whose placement is not settled yet."""
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
        if self.flow is not None:
            self.flow.start()

    async def stop(self) -> None:
        if self.flow is not None:
            await self.flow.stop()
        await self.deadlines.stop()
        self.intake.stop()
        held = self.held()
        if held:
            log.warning("at shutdown, requests ended still hold: %s", held)

    def held(self) -> dict[str, float]:
        """What requests hold now, by lease, where it is not nothing."""
        flow = self.flow
        found = {
            "admission slots": self.admission.active,
            "admission queue places": self.admission.waiting,
            "flow queue places": 0 if flow is None else flow.waiting,
            "body bytes": self.bodies.held,
            "open placements": self.open_placements,
            "replica slots": sum(backend.in_flight for backend in self.pool.backends),
            "reserved tokens": sum(self.reserved_tokens().values()),
        }
        return {name: value for name, value in found.items() if value}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await RequestLife(self, scope, receive, send).run()

    def tenant_views(self) -> list[dict[str, Any]]:
        """Every named tenant as `/admin/tenants` shows it."""
        tenancy, flow = self.tenancy, self.flow
        if tenancy is None:
            return []
        return tenancy.views(lambda name: 0 if flow is None else flow.waiting_of(name))

    def reserved_tokens(self) -> dict[str, float]:
        """Tokens each named tenant's requests reserved and have not settled."""
        return {} if self.tenancy is None else self.tenancy.reserved_tokens()


class RequestLife:
    __slots__ = (
        "_account",
        "_admitted",
        "_began",
        "_body",
        "_error",
        "_forwarding",
        "_issued",
        "_outcome",
        "_parts",
        "_placing",
        "_receive",
        "_request",
        "_scope",
        "_ticket",
        "_watcher",
        "exchange",
        "reply",
        "request_id",
    )

    def __init__(self, parts: ProxyHandler, scope: Scope, receive: Receive, send: Send) -> None:
        self._parts = parts
        self._scope = scope
        self._receive = receive
        self.request_id = parts.intake.request_id(scope["headers"])
        connection = scope.get(CLIENT_CONNECTION)
        self.reply = Reply(send, parts.metrics, connection, error_shape(scope["path"]))
        task = asyncio.current_task()
        assert task is not None
        self.exchange = Exchange(task, time.monotonic(), parts.settings.request_timeout)
        tenancy = parts.tenancy
        # What it takes, each given back once by `_end`.
        self._account: Account | None = (
            None if tenancy is None else tenancy.account(scope.get(KEY_POSITION, -1))
        )
        self._body = parts.bodies.lease()
        self._admitted = False
        self._ticket: Ticket | None = None
        self._placing: Placing | None = None
        self._forwarding: Forwarding | None = None
        self._watcher: asyncio.Task[None] | None = None
        # What it came to.
        self._request: RoutingInput | None = None
        self._issued: str | None = None
        self._outcome: Outcome | None = None
        self._error: GatewayError | None = None
        self._began = 0.0

    async def run(self) -> None:
        exchange = self.exchange
        self._parts.deadlines.add(exchange)
        try:
            with exchange.guard():
                await self._live()
        except GatewayError as error:
            # Without its traceback, whose frames hold this life: a cycle otherwise.
            self._error = error.with_traceback(None)
        except Interrupted as stop:  # its time ran out, or its client left, before it was sent
            self._error = client_error(stop.why, self._parts.settings.request_timeout)
        except asyncio.CancelledError:
            # The server cancels what still runs when its shutdown grace ends: the request is
            # answered if it still can be, and ends without an error.
            exchange.task.uncancel()
            self._error = refused("shutting_down")
        except Exception:
            log.exception("request %s failed in the gateway", self.request_id)
            self._error = refused("internal_error")
        finally:
            await self._end()

    async def _live(self) -> None:
        parts, scope = self._parts, self._scope
        body = await parts.intake.body(scope["headers"], self._receive, self.exchange, self._body)
        # From here, the client's hang-up interrupts the request wherever it waits.
        connection = scope.get(CLIENT_CONNECTION)
        if connection is not None:
            connection.watch(self.exchange)
        else:
            self._watcher = asyncio.create_task(self.exchange.watch_client(self._receive))
        admission = parts.admission
        if not admission.try_enter():
            cause = await admission.enter()
            if cause is not None:
                raise refused(cause)
        self._admitted = True
        request, path, self._issued = await parts.intake.parse(scope, body, scope.get(TENANT))
        self._request = request
        if self._account is not None:
            await self._account.admit(request)
        placement = await self._place(request)
        self._outcome = await self._forward(placement, body, path)

    async def _place(self, request: RoutingInput) -> Placement:
        """Routing entered once: at once, or under flow control when its turn comes, among
        the replicas with a free slot then."""
        parts = self._parts
        placing = self._placing = parts.router.placing(request)
        try:
            return await self._placed(placing)
        finally:
            if placing.placement is not None:
                parts.open_placements += 1

    async def _placed(self, placing: Placing) -> Placement:
        flow = self._parts.flow
        if flow is None:
            return await placing.place()
        account = self._account
        assert account is not None  # flow control counts tokens: every request has an account
        name, priority, weight = account.lane
        ticket = self._ticket = flow.enter(
            name, priority, weight, account.reserved, placing.request.model
        )
        ticket.pinned = placing.pinned
        return await flow.place(ticket, placing)

    async def _forward(self, placement: Placement, body: bytes, path: str) -> Outcome:
        parts, scope = self._parts, self._scope
        connection = scope.get(CLIENT_CONNECTION)
        client = scope.get("client")
        peer = connection.peer if connection is not None else client[0] if client else None
        outgoing = parts.forwarder.upstream.headers_for(
            scope["headers"], self.request_id.encode(), peer, scope.get("scheme", "http")
        )
        account = self._account
        forwarding = Forwarding(
            placement,
            body,
            outgoing,
            self.exchange,
            self.reply,
            # Not a bound method of this life: the forwarding it keeps would hold it in a
            # cycle, left for the garbage collector to find (with all the request holds).
            functools.partial(
                _gateway_headers, self._parts, self.request_id, self._issued, account
            ),
            scope["method"].encode(),
            path,
            tenant_priority=0 if account is None else account.priority,
            own_priority=None if account is None else account.own_priority,
            needs_usage=account is not None and account.needs_usage,
            counts_tokens=account is not None,
        )
        self._forwarding = forwarding
        self._began = time.perf_counter()
        return await parts.forwarder.forward(forwarding)

    async def _end(self) -> None:
        """Everything the request took, given back once, whatever ended it; then its
        placement settled."""
        parts, exchange = self._parts, self.exchange
        exchange.finish()
        parts.deadlines.discard(exchange)
        if self._watcher is not None:
            self._watcher.cancel()
        error, outcome = self._error, self._outcome
        if error is not None and not self.reply.begun:
            with contextlib.suppress(Exception):  # the connection may be gone already
                await self.reply.fail(error, [(b"x-request-id", self.request_id.encode())])
        status = (
            outcome.status if outcome is not None else error.status if error is not None else 499
        )
        if outcome is None and self._forwarding is not None:
            # Forwarding broke off: what it got as far as it went.
            outcome = self._outcome = self._forwarding.outcome(status)
        account = self._account
        served = 0.0 if account is None else account.settle(self._request, status, outcome)
        if self._ticket is not None:
            assert parts.flow is not None
            parts.flow.release(self._ticket, served)
        if self._admitted:
            parts.admission.leave()
        self._body.release()
        placing = self._placing
        placement = None if placing is None else placing.placement
        path = self._scope["path"]
        tenant = None if account is None else account.name
        if outcome is not None and placement is not None:
            parts.access_log.answered(placement, outcome, self.request_id, self._began, tenant)
        else:
            parts.access_log.rejected(self.request_id, path, status, _code(error), tenant)
        if placement is not None:
            parts.open_placements -= 1
            try:
                await placement.settle(outcome or placement.unsent(status))
            except Exception:  # what it recorded may stay; the request is over all the same
                log.exception("settling request %s failed", self.request_id)


def _gateway_headers(
    parts: ProxyHandler,
    request_id: str,
    issued: str | None,
    account: Account | None,
    decision: Decision,
) -> Headers:
    """What the gateway adds to a reply's headers, once a replica is chosen."""
    headers = [
        (b"x-gateway-route", decision.route.value.encode()),
        (b"x-request-id", request_id.encode()),
    ]
    backend = parts.public_names.header(decision.backend)
    if backend is not None:
        headers.append((b"x-gateway-backend", backend))
    if issued is not None:
        # No Max-Age: the binding itself expires after the TTL of inactivity; a key sent
        # back after that simply binds again.
        cookie = f"{parts.settings.sticky_cookie}={issued}"
        headers.append((b"set-cookie", f"{cookie}; Path=/; HttpOnly; SameSite=Lax".encode()))
    if account is not None:
        headers += account.headers(time.monotonic())
    return headers


def _code(error: GatewayError | None) -> str:
    """The access log's `error` of a request that was not answered by a replica."""
    return "client_disconnected" if error is None else error.code
