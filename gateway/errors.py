"""The gateway's error tree and the one renderer of OpenAI-style error bodies."""

from __future__ import annotations

import orjson


class GatewayError(Exception):
    """An error answered to the client in the OpenAI error shape."""

    status = 500
    error_type = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> bytes:
        return render_error(self.message, self.error_type, self.param, self.code)


class BadRequest(GatewayError):
    status = 400
    error_type = "invalid_request_error"


class Unauthorized(GatewayError):
    status = 401
    error_type = "authentication_error"


class Forbidden(GatewayError):
    status = 403
    error_type = "permission_error"


class NotFound(GatewayError):
    status = 404
    error_type = "invalid_request_error"


class MethodNotAllowed(GatewayError):
    status = 405
    error_type = "invalid_request_error"


class RequestTimeout(GatewayError):
    status = 408
    error_type = "invalid_request_error"


class PayloadTooLarge(GatewayError):
    status = 413
    error_type = "invalid_request_error"


class HeadersTooLarge(GatewayError):
    status = 431
    error_type = "invalid_request_error"


class Overloaded(GatewayError):
    status = 429
    error_type = "rate_limit_error"


class UpstreamFailed(GatewayError):
    status = 502
    error_type = "upstream_error"


class NoHealthyBackend(GatewayError):
    status = 503
    error_type = "service_unavailable"


class ShuttingDown(GatewayError):
    status = 503
    error_type = "service_unavailable"


class UpstreamTimeout(GatewayError):
    status = 504
    error_type = "upstream_timeout"


class LoopDetected(GatewayError):
    status = 508
    error_type = "invalid_request_error"


def render_error(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": error_type, "param": param, "code": code}}
    )


def sse_error(error: GatewayError) -> bytes:
    """The error as the last event of a stream whose response has already begun."""
    return b"data: " + error.body() + b"\n\n"
