"""Serving the gateway with uvicorn: request heads bounded by `--max-header-bytes` (431 past
it) and the graceful shutdown of docs/reliability.md. Under `--workers` each worker also names
itself in a header, publishes its gauges and stops when its supervisor is gone.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import socket
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any, cast

import uvicorn

from gateway.app import GatewayApp
from gateway.config import Settings
from gateway.control.gauges import publish_scrape_gauges
from gateway.errors import BadRequest, GatewayError, HeadersTooLarge
from gateway.proxy.access_log import flush_access_log

WORKER_HEADER = "x-gateway-worker"


@dataclass(frozen=True)
class WorkerRole:
    """One of several worker processes: its number, its supervisor and their shared socket."""

    number: int
    supervisor_pid: int
    listener: socket.socket


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)


def serve(app: GatewayApp, settings: Settings, worker: WorkerRole | None = None) -> None:
    """Serve until a signal has ended the shutdown; blocks."""
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        loop="auto",
        http=_http_protocol(settings.max_header_bytes),
        ws="none",
        lifespan="on",
        # Whole seconds in uvicorn's interface.
        timeout_graceful_shutdown=math.ceil(settings.shutdown_grace),
        h11_max_incomplete_event_size=settings.max_header_bytes,
        # The proxied replica's own Date and Server headers pass through unchanged.
        server_header=False,
        date_header=False,
        headers=[(WORKER_HEADER, str(worker.number))] if worker is not None else None,
        # The client's address is the peer's, unless the peer is a proxy the operator trusts.
        proxy_headers=bool(settings.trusted_proxies),
        forwarded_allow_ips=list(settings.trusted_proxies) or None,
    )
    server = GatewayServer(config, app, settings.shutdown_delay, worker)
    server.run(sockets=[worker.listener] if worker is not None else None)


class GatewayServer(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        app: GatewayApp,
        shutdown_delay: float,
        worker: WorkerRole | None = None,
    ) -> None:
        super().__init__(config)
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
        if self._exit_at is not None and not self.should_exit and time.monotonic() >= self._exit_at:
            super().handle_exit(self._exit_signal, None)
        if self._worker is not None and counter % 10 == 0:
            self._worker_tick(self._worker)
        return await super().on_tick(counter)

    def _worker_tick(self, worker: WorkerRole) -> None:
        if os.getppid() != worker.supervisor_pid and not self._orphaned:
            # The supervisor was killed without passing a signal on: nobody would stop us.
            self._orphaned = True
            self.handle_exit(signal.SIGTERM, None)
        components = self._app.components
        if components is not None:
            publish_scrape_gauges(components)


def _http_protocol(max_header_bytes: int) -> type[asyncio.Protocol] | str:
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # no httptools: h11, bounded by h11_max_incomplete_event_size
        return "h11"

    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        _head_bytes = 0
        _head_too_large = False

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(CoalescingTransport(transport))  # type: ignore[arg-type]

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_bytes = 0

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value))
            super().on_header(name, value)

        def _count(self, size: int) -> None:
            self._head_bytes += size
            if self._head_bytes > max_header_bytes:
                # Raised inside the parser: uvicorn answers through send_400_response.
                self._head_too_large = True
                raise ValueError("request head too large")

        def send_400_response(self, msg: str) -> None:
            error: GatewayError
            if self._head_too_large:
                error = HeadersTooLarge(
                    f"the request line and headers exceed {max_header_bytes} bytes",
                    code="headers_too_large",
                )
            else:
                error = BadRequest("invalid HTTP request", code="invalid_http")
            self.transport.write(_error_response(error))
            self.transport.close()

    return BoundedHttpToolsProtocol


class CoalescingTransport:
    """A transport that sends a response's head with the write that follows it (uvicorn writes
    them apart: two system calls), or at the end of the loop's turn if nothing follows."""

    __slots__ = ("_loop", "_pending", "_transport")

    def __init__(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self._loop = asyncio.get_running_loop()
        self._pending: bytes | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        pending = self._pending
        if pending is not None:
            self._pending = None
            self._transport.write(pending + bytes(data))
        elif data[:9] == b"HTTP/1.1 ":
            self._pending = bytes(data)
            self._loop.call_soon(self.flush)
        else:
            self._transport.write(data)

    def flush(self) -> None:
        pending = self._pending
        if pending is not None:
            self._pending = None
            self._transport.write(pending)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def get_write_buffer_size(self) -> int:
        held = len(self._pending) if self._pending is not None else 0
        return self._transport.get_write_buffer_size() + held

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def _error_response(error: GatewayError) -> bytes:
    body = error.body()
    head: list[Any] = [
        f"HTTP/1.1 {error.status} {_PHRASES.get(error.status, '')}\r\n".encode(),
        b"content-type: application/json\r\n",
        b"content-length: " + str(len(body)).encode() + b"\r\n",
        b"connection: close\r\n\r\n",
    ]
    return b"".join(head) + body


_PHRASES = {400: "Bad Request", 431: "Request Header Fields Too Large"}
