"""The gateway's error tree and the one renderer of OpenAI-style error bodies (and of
Anthropic-style ones, on the Messages API's paths). What each refusal answers (its code,
message and headers) is `prefix_gateway/refusals.py`'s table."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import orjson

Headers = tuple[tuple[bytes, bytes], ...]


class GatewayError(Exception):
    """An error answered to the client in the OpenAI error shape; every one has a code (the
    class's own when none is given), which the rejection metric is labelled with."""

    status = 500
    error_type = "server_error"
    default_code = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Headers = (),
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code: str = code or self.default_code
        self.headers = headers
        """Headers of this answer alone (a 405's `Allow`); the rest come from the table."""

    def body(self) -> bytes:
        return render_error(self.message, self.error_type, self.param, self.code)


class BadRequest(GatewayError):
    status = 400
    error_type = "invalid_request_error"
    default_code = "invalid_request"


class Unauthorized(GatewayError):
    status = 401
    error_type = "authentication_error"
    default_code = "unauthorized"


class Forbidden(GatewayError):
    status = 403
    error_type = "permission_error"
    default_code = "forbidden"


class NotFound(GatewayError):
    status = 404
    error_type = "invalid_request_error"
    default_code = "not_found"


class MethodNotAllowed(GatewayError):
    status = 405
    error_type = "invalid_request_error"
    default_code = "http_405"


class RequestTimeout(GatewayError):
    status = 408
    error_type = "invalid_request_error"
    default_code = "timeout"


class PayloadTooLarge(GatewayError):
    status = 413
    error_type = "invalid_request_error"
    default_code = "body_too_large"


class HeadersTooLarge(GatewayError):
    status = 431
    error_type = "invalid_request_error"
    default_code = "headers_too_large"


class Overloaded(GatewayError):
    status = 429
    error_type = "rate_limit_error"
    default_code = "overloaded"


class UpstreamFailed(GatewayError):
    status = 502
    error_type = "upstream_error"
    default_code = "upstream_failed"


class NoHealthyBackend(GatewayError):
    status = 503
    error_type = "service_unavailable"
    default_code = "no_healthy_backend"


class TooManyConnections(GatewayError):
    status = 503
    error_type = "service_unavailable"
    default_code = "too_many_connections"


class ShuttingDown(GatewayError):
    status = 503
    error_type = "service_unavailable"
    default_code = "shutting_down"


class UpstreamTimeout(GatewayError):
    status = 504
    error_type = "upstream_timeout"
    default_code = "upstream_timeout"


class LoopDetected(GatewayError):
    status = 508
    error_type = "invalid_request_error"
    default_code = "loop_detected"


def render_error(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": error_type, "param": param, "code": code}}
    )


def sse_error(error: GatewayError) -> bytes:
    """The error as the last event of a stream whose response has already begun."""
    return b"data: " + error.body() + b"\n\n"


_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
"""Anthropic's error type for each status (any other 4xx an `invalid_request_error`, any
other 5xx an `api_error`)."""


def anthropic_error(error: GatewayError) -> bytes:
    """The error in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`."""
    status = error.status
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return orjson.dumps({"type": "error", "error": {"type": kind, "message": error.message}})


def anthropic_event(error: GatewayError) -> bytes:
    """The error as the `error` event that ends an Anthropic stream already begun."""
    return b"event: error\ndata: " + anthropic_error(error) + b"\n\n"


@dataclass(frozen=True, slots=True)
class ErrorShape:
    """How one API's clients expect an error: a whole body, or the last event of a stream."""

    body: Callable[[GatewayError], bytes]
    event: Callable[[GatewayError], bytes]


OPENAI = ErrorShape(GatewayError.body, sse_error)
ANTHROPIC = ErrorShape(anthropic_error, anthropic_event)
_ANTHROPIC_PATH = "/v1/messages"


def error_shape(path: str) -> ErrorShape:
    """The shape of the errors answered on `path`: Anthropic's on the Messages API's."""
    if path == _ANTHROPIC_PATH or path.startswith(_ANTHROPIC_PATH + "/"):
        return ANTHROPIC
    return OPENAI
