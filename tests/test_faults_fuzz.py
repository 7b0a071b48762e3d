"""Fuzzing: malformed bodies, headers, encodings and methods at every endpoint.

Whatever arrives, the gateway answers with a status below 500 and stays up. hypothesis drives
raw requests (bytes on the socket too); schemathesis drives the OpenAPI schema the gateway
serves, which describes the control plane and the inference routes. Both are bounded in
examples so that the module runs in seconds.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error

from prefix_gateway.emulator.replicas import EmulatedReplicas
from tests.conftest import MODEL
from tests.support import GatewayProcess, metric_value

ADMIN = "fuzz-admin-token"
PATHS = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/models",
    "/health",
    "/ready",
    "/metrics",
    "/admin/explain",
    "/admin/backends",
    "/admin/backends/x/drain",
    "/v1/chat/completions/extra",
    "/nowhere",
    "/openapi.json",
]
METHODS = ["POST", "POST", "POST", "GET", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]
FIELDS = [
    "model",
    "messages",
    "prompt",
    "input",
    "stream",
    "stream_options",
    "max_tokens",
    "tools",
    "user",
    "prompt_cache_key",
    "n",
]


@pytest.fixture(scope="module")
def fleet() -> Iterator[EmulatedReplicas]:
    with EmulatedReplicas(1, MODEL) as started:
        yield started


@pytest.fixture(scope="module")
def target(fleet: EmulatedReplicas) -> Iterator[GatewayProcess]:
    args = ("--admin-token", ADMIN, "--max-body-bytes", "65536", "--health-interval", "60")
    with GatewayProcess(fleet.urls, *args) as gateway:
        yield gateway


@pytest.fixture(scope="module")
def http(target: GatewayProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=target.url, timeout=30) as client:
        yield client


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _valid() -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello there"}],
        "prompt": "hello there",
        "input": "hello there",
        "max_tokens": 3,
    }


@st.composite
def mutated_bodies(draw: st.DrawFn) -> bytes:
    """A valid request with some fields replaced by anything, in some encoding."""
    body = _valid()
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=4)):
        body[name] = draw(json_values)
    text = json.dumps(body)  # NaN and Infinity included: not valid JSON
    encoding = draw(st.sampled_from(["utf-8", "utf-8", "utf-16", "latin-1"]))
    return text.encode(encoding, errors="replace")


bodies = st.one_of(
    mutated_bodies(),
    json_values.map(lambda value: json.dumps(value).encode()),
    st.binary(max_size=300),
    st.just(b""),
    st.just(b"[" * 5000 + b"]" * 5000),
    st.just(b'{"model": "' + MODEL.encode() + b'", "messages": "' + b"x" * 70000 + b'"}'),
)
header_values = st.binary(max_size=60).map(
    lambda raw: bytes(byte for byte in raw if byte == 9 or 32 <= byte != 127)
)
# What an HTTP client library lets through: no leading or trailing whitespace.
client_header_values = header_values.map(lambda value: value.strip(b" \t"))
headers = st.dictionaries(
    st.sampled_from(
        [
            "content-type",
            "content-encoding",
            "x-session-id",
            "x-request-id",
            "cookie",
            "authorization",
            "accept",
            "accept-encoding",
            "x-forwarded-for",
            "expect",
        ]
    ),
    client_header_values,
    max_size=4,
)


def survived(target: GatewayProcess, http: httpx.Client) -> None:
    """The gateway is up, ready, and still proxies a plain request."""
    assert target.running
    assert http.get("/ready").status_code == 200
    reply = http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "still there?"}]},
    )
    assert reply.status_code == 200


def gone_up(target: GatewayProcess, before: str, name: str, **labels: str) -> float:
    """How much `name` with `labels` rose since the scrape `before`."""
    return metric_value(target.metrics(), name, **labels) - metric_value(before, name, **labels)


def test_no_request_gets_a_5xx(http: httpx.Client, target: GatewayProcess) -> None:
    before = target.metrics()

    @settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(method=st.sampled_from(METHODS), path=st.sampled_from(PATHS), body=bodies, extra=headers)
    def send(method: str, path: str, body: bytes, extra: dict[str, bytes]) -> None:
        if extra.get("expect") is not None:
            extra["expect"] = b"100-continue"
        response = http.request(method, path, content=body, headers=extra)
        assert response.status_code < 500, (response.status_code, response.text[:300])
        if response.status_code >= 400 and method != "HEAD":
            assert "error" in response.json() or "detail" in response.json()

    send()
    survived(target, http)
    # The fuzzing reached the gateway's refusals, each counted, not only its router.
    assert gone_up(target, before, "gateway_rejected_requests_total") > 10


def test_raw_header_bytes_never_get_a_5xx(target: GatewayProcess, http: httpx.Client) -> None:
    before = target.metrics()

    @settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        name=st.from_regex(r"[A-Za-z0-9!#$%&'*+.^_`|~-]{1,24}", fullmatch=True),
        value=header_values,
        path=st.sampled_from(PATHS[:4]),
    )
    def send(name: str, value: bytes, path: str) -> None:
        body = json.dumps(_valid()).encode()
        request = (
            f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n".encode()
            + name.encode()
            + b": "
            + value
            + b"\r\nconnection: close\r\n\r\n"
            + body
        )
        with socket.create_connection(("127.0.0.1", target.port), timeout=10) as raw:
            raw.sendall(request)
            status_line = raw.recv(65536).split(b"\r\n", 1)[0]
        assert status_line.startswith(b"HTTP/1.1 ")
        assert int(status_line.split()[1]) < 500, status_line

    send()
    survived(target, http)
    # The fuzzing reached the replica through the gateway, not only its refusals.
    assert gone_up(target, before, "gateway_requests_total", status="200") > 10


def test_the_openapi_schema_fuzzed_never_gets_a_5xx(
    target: GatewayProcess, http: httpx.Client
) -> None:
    """Every operation of /openapi.json, with data that fits the schema and data that does not."""
    schema = schemathesis.openapi.from_url(target.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10
    # Backends added by the fuzzing (unhealthy, some for made-up models, which then answer 503
    # "no healthy backend") must not change what the other operations meet: those go last.
    operations.sort(key=lambda operation: operation.path.startswith("/admin/backends"))
    calls = 0
    for operation in operations:

        @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def call(case: schemathesis.Case[Any]) -> None:
            nonlocal calls
            calls += 1
            case.call_and_validate(
                base_url=target.url,
                headers={"authorization": f"Bearer {ADMIN}"},
                checks=[not_a_server_error],
            )

        call()
    assert calls >= len(operations)
    survived(target, http)


def test_the_schema_describes_the_inference_routes(http: httpx.Client) -> None:
    paths = http.get("/openapi.json").json()["paths"]
    for route in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"):
        assert "post" in paths[route]
    assert {"get", "delete"} <= set(paths["/v1/responses/{response_id}"])
    assert "post" in paths["/v1/responses/{response_id}/cancel"] and "post" in paths["/tokenize"]
