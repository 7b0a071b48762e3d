"""Every body the admin API takes is bounded before it is read: refused at once when its
`Content-Length` is over `--max-body-bytes`, and read here, counted against a budget of
`--max-pending-body-bytes` of its own, before FastAPI sees it. FastAPI would read a body
whole, of any size, before an endpoint could look at its length. Other control-plane paths
take no body: they are answered without reading one (and the connection closed, server.py).
"""

from __future__ import annotations

from prefix_gateway.errors import GatewayError
from prefix_gateway.proxy.admission import BodyBytes
from prefix_gateway.proxy.asgi import (
    ASGIApp,
    Message,
    Receive,
    Scope,
    Send,
    header,
    read_body,
    send_error,
)
from prefix_gateway.refusals import refused

ADMIN = "/admin"


class BoundedBodies:
    """ASGI middleware: the app gets the body already read, within the limits."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, max_pending_body_bytes: int) -> None:
        self._app = app
        self._limit = max_body_bytes
        self._bodies = BodyBytes(max_pending_body_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or not scope["path"].startswith(ADMIN)
            or not _has_body(scope["headers"])
        ):
            await self._app(scope, receive, send)
            return
        try:
            declared = int(header(scope["headers"], b"content-length") or 0)
        except ValueError:
            declared = 0  # the HTTP parser has refused such a head already
        lease = self._bodies.lease()
        try:
            try:
                if declared > self._limit:
                    raise refused("body_too_large", self._limit)
                body = await read_body(receive, self._limit, lease)
            except GatewayError as error:
                await send_error(send, error)
                return
            await self._app(scope, _replay(body, receive), send)
        finally:
            lease.release()


def _has_body(headers: list[tuple[bytes, bytes]]) -> bool:
    for name, value in headers:
        if name == b"transfer-encoding" or (name == b"content-length" and value != b"0"):
            return True
    return False


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that gives `body` whole once, then what the connection says."""
    given = False

    async def replayed() -> Message:
        nonlocal given
        if given:
            return await receive()
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed
