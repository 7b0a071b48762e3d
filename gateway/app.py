"""The ASGI application: the lean proxy path for inference, FastAPI for everything else."""

from __future__ import annotations

import logging

from gateway.asgi import ASGIApp, Receive, Scope, Send, send_error
from gateway.backends import BackendPool
from gateway.components import Components
from gateway.config import Settings
from gateway.control import build_control_app
from gateway.errors import MethodNotAllowed
from gateway.parsing import ENDPOINTS

log = logging.getLogger("gateway.app")


class GatewayApp:
    def __init__(self, settings: Settings, pool: BackendPool | None = None) -> None:
        self.settings = settings
        self._pool = pool
        self.components: Components | None = None
        self._control: ASGIApp | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            assert self.components is not None and self._control is not None
            if scope["path"] in ENDPOINTS:
                if scope["method"] == "POST":
                    await self.components.proxy(scope, receive, send)
                else:
                    error = MethodNotAllowed(f"use POST for {scope['path']}", code="http_405")
                    await send_error(send, error, [(b"allow", b"POST")])
            else:
                await self._control(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    self.components = Components.build(self.settings, self._pool)
                    await self.components.start()
                    self._control = build_control_app(self.components)
                except Exception as exc:
                    log.exception("start-up failed")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.components is not None:
                    await self.components.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return
