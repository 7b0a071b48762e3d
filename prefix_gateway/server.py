"""Serving the gateway with uvicorn: every request head bounded from its first byte (bytes,
header lines, time), every body and idle connection in time, a cap on connections (in all and
per client address), and the graceful shutdown of docs/reliability.md.
Under `--workers` each worker also names itself in a header, publishes its gauges and stops
when its supervisor is gone. With `--metrics-port` the server listens on two ports, both
bounded alike.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from types import FrameType
from typing import ClassVar, cast

import uvicorn
from uvicorn.config import STARTUP_FAILURE
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from prefix_gateway.app import GatewayApp
from prefix_gateway.config import Settings
from prefix_gateway.connections import ClientConnections, connection_cap
from prefix_gateway.control.gauges import publish_scrape_gauges
from prefix_gateway.errors import GatewayError
from prefix_gateway.listeners import Listeners, bind_listeners
from prefix_gateway.proxy.access_log import flush_access_log
from prefix_gateway.proxy.deadlines import CLIENT_CONNECTION, Exchange, Why
from prefix_gateway.refusals import CLOSE, answer_head, count_refusal, phrase, refused
from prefix_gateway.transport import CoalescingTransport

log = logging.getLogger("prefix_gateway.server")

WORKER_HEADER = "x-gateway-worker"


@dataclass(frozen=True)
class WorkerRole:
    """One of several worker processes: its number, its supervisor and their shared sockets."""

    number: int
    supervisor_pid: int
    listeners: Listeners


@dataclass(frozen=True)
class HeadLimits:
    """What a connection may send before its request exists."""

    max_bytes: int
    max_headers: int
    timeout: float
    max_connections: int
    body_timeout: float
    """From the end of a head to the end of its body, for what no application timer watches."""


def serve(app: GatewayApp, settings: Settings, worker: WorkerRole | None = None) -> None:
    """Serve until a signal has ended the shutdown; blocks."""
    limits = HeadLimits(
        settings.max_header_bytes,
        settings.max_headers,
        settings.head_timeout,
        connection_cap(settings),
        settings.body_timeout,
    )
    clients = ClientConnections(settings.max_connections_per_client)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        # uvicorn's records go through the root logger, in --log-format (prefix_gateway.logs).
        log_config=None,
        access_log=False,
        loop="auto",
        http=_http_protocol(limits, Refusals(app), clients),
        ws="none",
        lifespan="on",
        # Whole seconds in uvicorn's interface.
        timeout_graceful_shutdown=math.ceil(settings.shutdown_grace),
        # The proxied replica's own Date and Server headers pass through unchanged.
        server_header=False,
        date_header=False,
        headers=[(WORKER_HEADER, str(worker.number))] if worker is not None else None,
        # The client's address is the peer's, unless the peer is a proxy the operator trusts.
        proxy_headers=bool(settings.trusted_proxies),
        forwarded_allow_ips=list(settings.trusted_proxies) or None,
    )
    server = GatewayServer(config, app, settings.shutdown_delay, worker, settings.head_timeout)
    listeners = worker.listeners if worker is not None else _own_listeners(settings)
    # Without sockets of its own, uvicorn binds --host and --port itself.
    server.run(sockets=listeners.sockets if listeners is not None else None)


def _own_listeners(settings: Settings) -> Listeners | None:
    """One process's sockets: bound here only when there are two to serve."""
    if not settings.metrics_port:
        return None
    try:
        listeners = bind_listeners(settings)
    except OSError as exc:
        log.error("cannot listen: %s", exc)
        sys.exit(STARTUP_FAILURE)  # as uvicorn exits when it cannot bind its port
    log.info("serving on %s", listeners.describe())
    return listeners


class GatewayServer(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        app: GatewayApp,
        shutdown_delay: float,
        worker: WorkerRole | None = None,
        head_timeout: float = 10.0,
    ) -> None:
        super().__init__(config)
        # uvicorn ticks every 0.1 s; heads are checked an eighth of their timeout apart.
        self._head_ticks = max(1, min(10, round(head_timeout / 8 / 0.1)))
        self._app = app
        self._delay = shutdown_delay
        self._exit_at: float | None = None
        self._exit_signal = int(signal.SIGTERM)
        self._worker = worker
        self._orphaned = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._app.begin_shutdown()
        if self._delay > 0 and self._exit_at is None and not self.should_exit:
            # The listener stays open a little longer; `on_tick` closes it. A second signal
            # does not wait.
            self._exit_at = time.monotonic() + self._delay
            self._exit_signal = sig
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        flush_access_log()
        if counter % self._head_ticks == 0:
            self._expire()
        if self._exit_at is not None and not self.should_exit and time.monotonic() >= self._exit_at:
            super().handle_exit(self._exit_signal, None)
        if self._worker is not None and counter % 10 == 0:
            self._worker_tick(self._worker)
        return await super().on_tick(counter)

    def _expire(self) -> None:
        now = asyncio.get_running_loop().time()
        for connection in tuple(self.server_state.connections):
            if isinstance(connection, BoundedHttpToolsProtocol):
                connection.expire(now)

    def _worker_tick(self, worker: WorkerRole) -> None:
        if os.getppid() != worker.supervisor_pid and not self._orphaned:
            # The supervisor was killed without passing a signal on: nobody would stop us.
            self._orphaned = True
            self.handle_exit(signal.SIGTERM, None)
        components = self._app.components
        if components is not None:
            publish_scrape_gauges(components)


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol with each request head bounded in bytes, lines and time.

    Head bytes are counted in `data_received`, before httptools buffers them (it keeps a
    header line until it ends): a chunk that would take the head past its limit is fed only up
    to it, and the request is refused if the head has not ended there. The time limit is
    checked by the server's tick (`expire`), so a request costs no timer; so are the body's
    and, besides uvicorn's keep-alive timer, an idle connection's. A connection is kept alive
    only once its request's body is in whole: an answer before that closes it, or the rest of
    the body would hold it with uvicorn's keep-alive timer stopped.
    """

    limits: ClassVar[HeadLimits]
    refusals: ClassVar[Refusals]
    clients: ClassVar[ClientConnections]

    _in_head = True
    """The next bytes belong to a request head."""
    _head_bytes = 0
    _head_lines = 0
    _head_since = 0.0
    """When the head under way began (loop time), 0 when none is."""
    _body_since = 0.0
    """When the head of the request whose body is under way ended."""
    _active_at = 0.0
    """When the connection last received bytes or finished a response."""
    _keep_alive = True
    """Whether the request under way may keep its connection, once its body is in whole."""
    _peer: str | None = None
    _watched: Exchange | None = None
    """The request last told to `watch` the connection."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(CoalescingTransport(transport))  # type: ignore[arg-type]
        if len(self.connections) > self.limits.max_connections:
            self._refuse(refused("too_many_connections"))
            return
        peer = self.client[0] if self.client else ""
        if not self.clients.admit(peer):
            self._refuse(refused("too_many_client_connections", self.clients.cap))
            return
        self._peer = peer
        self._head_since = self._active_at = self.loop.time()

    def data_received(self, data: bytes) -> None:
        self._active_at = self.loop.time()
        if self._in_head:
            if not self._head_since:
                self._head_since = self.loop.time()
            room = self.limits.max_bytes - self._head_bytes
            if len(data) > room:
                self._past_limit(data, room)
                return
            self._head_bytes += len(data)
        super().data_received(data)

    def _past_limit(self, data: bytes | memoryview, room: int) -> None:
        """`data` takes the head past its limit unless the head ends in its first `room` bytes."""
        view = memoryview(data)
        self._head_bytes = self.limits.max_bytes
        super().data_received(cast(bytes, view[:room]))
        if self.transport.is_closing():
            return
        if self._in_head and self._head_bytes:  # still the same head: it did not end in time
            self._refuse(refused("headers_too_large", self.limits.max_bytes))
            return
        self.data_received(cast(bytes, view[room:]))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_lines += 1
        if self._head_lines > self.limits.max_headers:
            raise ValueError("too many header lines")  # the parser fails: send_400_response
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_since = 0.0
        self.scope[CLIENT_CONNECTION] = self  # type: ignore[literal-required]
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None:
            self._keep_alive, cycle.keep_alive = cycle.keep_alive, False
            self._body_since = self.loop.time()

    @property
    def peer(self) -> str:
        """The address at the connection's other end (not what a proxy says it forwards)."""
        return self.client[0] if self.client else ""

    def watch(self, exchange: Exchange) -> None:
        """Interrupt `exchange` if the connection is lost before it is done (a done exchange
        ignores it): no task per request listens for the hang-up."""
        self._watched = exchange

    def drop(self) -> None:
        """Close the connection now, discarding unsent bytes: its client stopped reading, or its
        response broke off where no error can be told any more."""
        cycle = self.cycle
        if cycle is not None:
            cycle.disconnected = True  # the response is left unfinished on purpose
        self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._peer is not None:
            self.clients.release(self._peer)
            self._peer = None
        super().connection_lost(exc)
        if self._watched is not None:
            self._watched.interrupt(Why.DISCONNECTED)
            self._watched = None

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head = True
        self._head_bytes = self._head_lines = 0
        self._body_since = 0.0
        cycle = self.cycle
        if cycle is not None and not cycle.response_started:
            cycle.keep_alive = self._keep_alive

    def on_response_complete(self) -> None:
        self._active_at = self.loop.time()
        if self._body_since:  # a pipelined request's: timed from when it is served
            self._body_since = self._active_at
        super().on_response_complete()

    def shutdown(self) -> None:
        self._keep_alive = False
        super().shutdown()

    def expire(self, now: float) -> None:
        """Close the connection if its head or body has taken too long, or it has been idle
        well past uvicorn's keep-alive timeout (whose timer a stray byte stops)."""
        cycle, idle = self.cycle, now - self._active_at
        if self._body_since:
            self._expire_body(now, cycle)
        elif self._head_since or (cycle is not None and not cycle.response_complete):
            self._expire_head(now)
        elif idle > self.timeout_keep_alive + self.limits.timeout and not self.pipeline:
            self.transport.close()

    def _expire_body(self, now: float, cycle: RequestResponseCycle | None) -> None:
        if now - self._body_since <= self.limits.body_timeout + _APP_FIRST or self.pipeline:
            return
        self._body_since = 0.0
        if cycle is None or cycle.response_complete or self.transport.is_closing():
            return
        late = refused("body_timeout")
        if not cycle.response_started:
            self.transport.write(_error_response(late))
        self.transport.close()
        self.refusals.count(late)

    def _expire_head(self, now: float) -> None:
        since = self._head_since
        if not since or now - since <= self.limits.timeout:
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            return  # a response is still being written: a head pipelined behind it waits
        self._head_since = 0.0
        if not self._head_bytes:  # nothing was sent: nothing to answer
            self.transport.close()
            return
        self._refuse(refused("head_timeout", self.limits.timeout))

    def send_400_response(self, msg: str) -> None:
        if self._head_lines > self.limits.max_headers:
            self._refuse(refused("too_many_headers", self.limits.max_headers))
        else:
            self._refuse(refused("invalid_http"))

    def _refuse(self, error: GatewayError) -> None:
        """Answer in the OpenAI error shape and close the connection (only close it when a
        response to an earlier request is still being written)."""
        self._in_head = False
        self._head_since = 0.0
        if not self.transport.is_closing():
            cycle = self.cycle
            if cycle is None or cycle.response_complete:
                self.transport.write(_error_response(error))
            self.transport.close()
        self.refusals.count(error)


class Refusals:
    """Counts what the protocol refuses in `gateway_rejected_requests_total`, once it exists."""

    def __init__(self, app: GatewayApp) -> None:
        self._app = app

    def count(self, error: GatewayError) -> None:
        components = self._app.components
        if components is not None:
            count_refusal(components.metrics, error)


def _http_protocol(
    limits: HeadLimits, refusals: Refusals, clients: ClientConnections
) -> type[BoundedHttpToolsProtocol]:
    """The protocol class uvicorn makes per connection, bound to these limits."""
    return type(
        "BoundedHttpToolsProtocol",
        (BoundedHttpToolsProtocol,),
        {"limits": limits, "refusals": refusals, "clients": clients},
    )


_APP_FIRST = 2.0
"""Seconds past the body timeout before the server closes a body: the proxy path's own timer
answers first, with the request's headers (its deadline watch may notice it a second late)."""


def _error_response(error: GatewayError) -> bytes:
    """`error`'s whole answer, as the protocol writes it before a request exists: the
    connection is closed after it whatever the table says."""
    body = error.body()
    headers = answer_head(error, body)
    if CLOSE not in headers:
        headers.append(CLOSE)
    lines = [f"HTTP/1.1 {error.status} {phrase(error.status)}".encode()]
    lines.extend(name + b": " + value for name, value in headers)
    return b"\r\n".join(lines) + b"\r\n\r\n" + body
