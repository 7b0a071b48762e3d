"""The admin API's guard and route class, on FastAPI: the rules are
`prefix_gateway.auth.AdminAccess`. The control plane's errors are answered as the proxy's are
(`prefix_gateway/refusals.py`), but not counted in `gateway_rejected_requests_total`: that
counts the requests the gateway serves."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from fastapi.routing import APIRoute

from prefix_gateway.auth import AdminAccess
from prefix_gateway.errors import GatewayError
from prefix_gateway.refusals import headers_of

Guard = Callable[[Request], Awaitable[None]]


class AdminRoute(APIRoute):
    """Answers a `GatewayError` raised by a dependency or an endpoint in the OpenAI error shape."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                return await handler(request)
            except GatewayError as error:
                return error_response(error)

        return handle


def error_response(error: GatewayError) -> Response:
    """`error` answered on FastAPI, with the headers the refusals' table gives it."""
    headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in headers_of(error)}
    return Response(error.body(), error.status, headers, media_type="application/json")


def admin_guard(access: AdminAccess) -> Guard:
    """A dependency that lets through only what `access` allows."""

    async def require_admin(request: Request) -> None:
        headers = request.headers
        header = headers.get("authorization")
        authorization = header.encode("latin-1") if header is not None else None
        client = request.client
        forwarded = [
            value.decode("latin-1")
            for name, value in request.scope["headers"]
            if name == b"x-forwarded-for" or name == b"forwarded"
        ]
        access.check(
            authorization,
            headers.get("host"),
            headers.get("origin"),
            client.host if client is not None else None,
            forwarded,
        )

    return require_admin
