"""The one boundary between a failure and the client's answer.

`REFUSALS` is the table of the refusals the gateway gives on its own account: for each code,
the error class (which fixes the status and the OpenAI error type), the message and the headers
the answer carries. Errors raised with a message of their own elsewhere (a body that does not
parse, an unknown model, a missing key) take their headers from the same place: `headers_of`.
`count_refusal` is the one place where `gateway_rejected_requests_total` is counted, labelled
with the status and the code the client was given.

Every layer may import this module; it imports nothing of the gateway but the error tree and
the metrics, so the proxy's interruption reasons are mapped to codes in `proxy/deadlines.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus

from prefix_gateway.errors import (
    BadRequest,
    Forbidden,
    GatewayError,
    Headers,
    HeadersTooLarge,
    LoopDetected,
    MethodNotAllowed,
    NoHealthyBackend,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    RequestTimeout,
    ShuttingDown,
    TooManyConnections,
    Unauthorized,
    UpstreamFailed,
    UpstreamTimeout,
)
from prefix_gateway.metrics import Metrics

RETRY_AFTER = (b"retry-after", b"1")
"""On an overload refusal: worth trying again shortly."""
CLOSE = (b"connection", b"close")
"""On an answer given before the request's body was read whole: the rest is not waited for."""
_CHALLENGE = (b"www-authenticate", b"Bearer")
_JSON = (b"content-type", b"application/json")


@dataclass(frozen=True, slots=True)
class Refusal:
    kind: type[GatewayError]
    message: str
    """A format string of the values `refused` is given (the limit that ran out...)."""
    headers: Headers = ()


REFUSALS: dict[str, Refusal] = {
    # The connection and the request head (server.py): answered, then the connection closed.
    "too_many_connections": Refusal(
        TooManyConnections,
        "the gateway has as many connections open as it may; retry later",
        (CLOSE, RETRY_AFTER),
    ),
    "too_many_client_connections": Refusal(
        Overloaded,
        "your address has {0} connections open, as many as one client may; close some or retry"
        " later",
        (CLOSE, RETRY_AFTER),
    ),
    "invalid_http": Refusal(BadRequest, "invalid HTTP request", (CLOSE,)),
    "head_timeout": Refusal(
        RequestTimeout,
        "the request line and headers did not arrive within {0:g} s",
        (CLOSE,),
    ),
    "headers_too_large": Refusal(
        HeadersTooLarge, "the request line and headers exceed {0} bytes", (CLOSE,)
    ),
    "too_many_headers": Refusal(
        HeadersTooLarge, "the request has more than {0} header lines", (CLOSE,)
    ),
    # In front of the proxy path (app.py).
    "loop_detected": Refusal(
        LoopDetected,
        "this request already passed through the gateway: a backend points back at it",
    ),
    "http_405": Refusal(MethodNotAllowed, "use {0} for {1}"),
    # The two ports of --metrics-port (app.py); like the control plane's errors, not counted.
    "metrics_elsewhere": Refusal(
        NotFound, "/metrics is served on the gateway's metrics port, not on this one"
    ),
    "metrics_port_only": Refusal(NotFound, "this port serves GET /metrics and nothing else"),
    # The body (proxy/asgi.py, proxy/handler.py): refused before it was read whole.
    "body_too_large": Refusal(
        PayloadTooLarge, "request body exceeds the limit of {0} bytes", (CLOSE,)
    ),
    "pending_bodies": Refusal(
        Overloaded,
        "the gateway holds as many request bodies as it may while they arrive; retry later",
        (CLOSE, RETRY_AFTER),
    ),
    "body_timeout": Refusal(RequestTimeout, "the request body did not arrive in time", (CLOSE,)),
    "disconnected": Refusal(BadRequest, "client disconnected before sending the body", (CLOSE,)),
    # The admin API open on loopback without a token (auth.py): not for pages in a browser.
    "foreign_host": Refusal(
        Forbidden, "the admin API answers only requests addressed to a loopback host, not {0!r}"
    ),
    "foreign_origin": Refusal(
        Forbidden, "the admin API answers no request sent by a page from another origin ({0!r})"
    ),
    "foreign_client": Refusal(
        Forbidden,
        "without --admin-token the admin API answers only clients on this machine, not {0!r}",
    ),
    # Admission (proxy/admission.py).
    "overloaded": Refusal(
        Overloaded,
        "the gateway is at its concurrency limit and its queue is full; retry later",
        (RETRY_AFTER,),
    ),
    "queue_timeout": Refusal(
        Overloaded, "no capacity was freed in time; retry later", (RETRY_AFTER,)
    ),
    "shutting_down": Refusal(ShuttingDown, "the gateway is shutting down"),
    # A tenant's limits (tenants/tenant.py): the message says which; Retry-After is its own.
    "rate_limit_exceeded": Refusal(Overloaded, "{0}"),
    # No replica could take the request: none serves the model (routing/router.py), or each
    # one tried refused the connection (proxy/forwarder.py). One answer for both.
    "no_healthy_backend": Refusal(
        NoHealthyBackend,
        "no healthy backend serves model `{0}`; retry later",
        (RETRY_AFTER,),
    ),
    # A LoRA adapter of `lora_adapters` that no replica tried loaded (backends/adapters.py).
    "adapter_unavailable": Refusal(
        NoHealthyBackend, "adapter unavailable: LoRA adapter `{0}` could not be loaded; retry later"
    ),
    # The replicas (proxy/upstream.py) and the deadlines (proxy/deadlines.py).
    "upstream_unreachable": Refusal(UpstreamFailed, "the replica could not be reached"),
    "upstream_failed": Refusal(UpstreamFailed, "the replica's response was not valid HTTP"),
    "first_byte_timeout": Refusal(UpstreamTimeout, "upstream sent nothing within {0:g} s"),
    "stream_broken": Refusal(UpstreamFailed, "the upstream response broke off"),
    "stream_idle_timeout": Refusal(UpstreamTimeout, "upstream sent nothing for {0:g} s"),
    "request_timeout": Refusal(UpstreamTimeout, "the request took longer than {0:g} s"),
    "upstream_stalled": Refusal(UpstreamFailed, "the replica stopped producing output"),
    # A fault of the gateway's own (logged with its traceback): the request is ended cleanly.
    "internal_error": Refusal(GatewayError, "the gateway failed while handling the request"),
}


def refused(
    code: str, *values: object, message: str | None = None, headers: Headers = ()
) -> GatewayError:
    """The client's error for refusal `code`; `values` fill its message, `headers` are this
    answer's own (a 405's `Allow`)."""
    refusal = REFUSALS[code]
    text = refusal.message.format(*values) if message is None else message
    return refusal.kind(text, code=code, headers=headers)


def model_not_found(model: str) -> NotFound:
    """OpenAI's answer for a model that does not exist: also a tenant's for one it may not use
    (a model it may not use does not exist for it)."""
    return NotFound(f"The model `{model}` does not exist.", param="model", code="model_not_found")


_BY_STATUS: dict[int, type[GatewayError]] = {
    400: BadRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    405: MethodNotAllowed,
}


def of_status(status: int, message: str, headers: Headers = ()) -> GatewayError:
    """An error the web framework raised with a bare status (an unknown path, a wrong method
    on the control plane), in the error tree; its code is `http_<status>`."""
    code = f"http_{status}"
    kind = _BY_STATUS.get(status)
    if kind is not None:
        return kind(message, code=code, headers=headers)
    error = GatewayError(message, code=code, headers=headers)
    error.status = status
    error.error_type = "invalid_request_error" if status < 500 else "server_error"
    return error


def headers_of(error: GatewayError) -> Headers:
    """The headers `error`'s answer carries besides its content type and length."""
    refusal = REFUSALS.get(error.code)
    # By code and class: a control-plane 400 that shares a code with a refusal is not one.
    carried = refusal.headers if refusal is not None and type(error) is refusal.kind else ()
    if error.status == 401:
        carried = (*carried, _CHALLENGE)
    return (*carried, *error.headers) if error.headers else carried


def answer_head(error: GatewayError, body: bytes) -> list[tuple[bytes, bytes]]:
    """Every header of `error`'s answer, whose body is `body`."""
    return [_JSON, (b"content-length", str(len(body)).encode()), *headers_of(error)]


def phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""


def count_refusal(metrics: Metrics, error: GatewayError) -> None:
    """Count an error answered to a client: by the status and the code it was given."""
    metrics.rejected.labels(str(error.status), error.code).inc()
