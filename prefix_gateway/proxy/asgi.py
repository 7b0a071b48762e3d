"""Small ASGI helpers for the lean request path: types, headers, bounded input, errors."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from prefix_gateway.errors import OPENAI, ErrorShape, GatewayError
from prefix_gateway.proxy.admission import BodyLease
from prefix_gateway.refusals import answer_head, refused

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_JSON = (b"content-type", b"application/json")


def header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None


async def read_body(receive: Receive, limit: int, lease: BodyLease) -> bytes:
    """The whole body, at most `limit` bytes, each chunk counted in `lease` as it comes (and
    counted there until its holder releases it, whatever became of the read)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise refused("disconnected")
        chunk = message.get("body", b"")
        if size + len(chunk) > limit:
            raise refused("body_too_large", limit)
        if not lease.take(len(chunk)):
            raise too_many_pending_bodies()
        size += len(chunk)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def too_many_pending_bodies() -> GatewayError:
    return refused("pending_bodies")


async def send_error(
    send: Send,
    error: GatewayError,
    extra_headers: list[tuple[bytes, bytes]] | None = None,
    shape: ErrorShape = OPENAI,
) -> None:
    """Answer `error` in `shape` with the headers the table gives it; `extra_headers`: the
    request's own (its id, the replica tried). Counting it is the caller's
    (`refusals.count_refusal`)."""
    body = shape.body(error)
    headers = answer_head(error, body)
    if extra_headers:
        headers.extend(extra_headers)
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def send_json(send: Send, status: int, body: bytes) -> None:
    headers = [_JSON, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
