"""Errors answered to clients in vLLM's shape: the type named after the status
(`BadRequestError`, `NotFoundError`), the status number in `code`.
"""

from __future__ import annotations

import orjson


class EmulatorError(Exception):
    status = 500
    error_type = "InternalServerError"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> bytes:
        return render_error(self.status, self.error_type, self.message, self.param)


class InvalidRequest(EmulatorError):
    status = 400
    error_type = "BadRequestError"


class NotFound(EmulatorError):
    status = 404
    error_type = "NotFoundError"


class ResponseNotFound(EmulatorError):
    """vLLM's answer for a stored response it does not hold (also for `previous_response_id`)."""

    status = 404
    error_type = "invalid_request_error"

    def __init__(self, response_id: str) -> None:
        super().__init__(f"Response with id '{response_id}' not found.", param="response_id")


class InvalidResponseRequest(EmulatorError):
    status = 400
    error_type = "invalid_request_error"


class MethodNotAllowed(EmulatorError):
    status = 405
    error_type = "MethodNotAllowed"


class PayloadTooLarge(EmulatorError):
    status = 413
    error_type = "RequestEntityTooLarge"


def render_error(status: int, error_type: str, message: str, param: str | None = None) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": error_type, "param": param, "code": status}}
    )
