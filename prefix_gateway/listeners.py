"""The sockets the gateway listens on: the API's port and, with `--metrics-port`, a port of its
own for `/metrics` (docs/metrics.md#the-metrics-port).

They are bound here, before the server runs, when uvicorn cannot bind them itself: for several
worker processes, which accept from the supervisor's sockets, and for a second port, since
uvicorn binds one host and port. Every socket is served by the same bounded HTTP protocol; the
application tells the ports apart by the local port of each request's connection.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from prefix_gateway.config import Settings

_LISTEN_BACKLOG = 2048
"""uvicorn's own default backlog."""


@dataclass(frozen=True)
class Listeners:
    api: socket.socket
    metrics: socket.socket | None = None

    @property
    def sockets(self) -> list[socket.socket]:
        return [self.api] if self.metrics is None else [self.api, self.metrics]

    def describe(self) -> str:
        """Where they listen, for the log: `HOST:PORT`, and the metrics port's if any."""
        text = _address(self.api)
        return text if self.metrics is None else f"{text} (/metrics on {_address(self.metrics)})"

    def close(self) -> None:
        for listener in self.sockets:
            listener.close()


def bind_listeners(settings: Settings) -> Listeners:
    """Bind and listen on `--port` and, if set, `--metrics-port`, both at `--host`; OSError
    when either cannot be bound (nothing is left open then)."""
    api = _listen(settings.host, settings.port)
    if not settings.metrics_port:
        return Listeners(api)
    try:
        return Listeners(api, _listen(settings.host, settings.metrics_port))
    except BaseException:
        api.close()
        raise


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=_LISTEN_BACKLOG)


def _address(listener: socket.socket) -> str:
    host, port = listener.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
