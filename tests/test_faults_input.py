"""Bad and hostile input, credentials, and privacy: every refusal an OpenAI-style 4xx.

One gateway in front of a fake replica that records what it is sent (module fixtures), plus
gateways of their own where a test needs other settings.
"""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator

import httpx
import openai
import orjson
import pytest

from loadtest.fault_load import rss_bytes
from tests.conftest import MODEL
from tests.fault_servers import FaultServer
from tests.support import PATIENCE_SECONDS, GatewayProcess, metric_value, wait_until

KEYS = ("first-key", "second-key")
UPSTREAM_KEY = "replica-secret"


@pytest.fixture(scope="module")
def replica() -> Iterator[FaultServer]:
    with FaultServer() as server:
        yield server


@pytest.fixture(scope="module")
def guarded(replica: FaultServer) -> Iterator[GatewayProcess]:
    args = [f"--api-key={key}" for key in KEYS]
    args += ["--upstream-api-key", UPSTREAM_KEY, "--max-header-bytes", "8192"]
    args += ["--max-json-depth", "16", "--max-body-bytes", "100000"]
    # No test here waits for a stream to go idle; the body timeout is waited out once.
    args += ["--stream-idle-timeout", "30", "--body-timeout", "2", "--log-level", "debug"]
    with GatewayProcess([f"{MODEL}={replica.url}"], *args) as gateway:
        yield gateway


def _post(gateway: GatewayProcess, body: bytes, key: str | None = KEYS[0]) -> httpx.Response:
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    return httpx.post(
        gateway.url + "/v1/chat/completions",
        content=body,
        headers=headers,
        timeout=PATIENCE_SECONDS,
    )


def _chat(content: str = "hello", **extra: object) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}
    return orjson.dumps(body)


def _error(response: httpx.Response) -> dict[str, object]:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return dict(error)


def test_api_keys_are_required_on_v1_only(guarded: GatewayProcess) -> None:
    missing = _post(guarded, _chat(), key=None)
    assert missing.status_code == 401
    assert missing.headers["www-authenticate"] == "Bearer"
    assert _error(missing)["code"] == "missing_api_key"
    wrong = _post(guarded, _chat(), key="first-key-but-longer")
    assert wrong.status_code == 401 and _error(wrong)["code"] == "invalid_api_key"
    assert _post(guarded, _chat(), key=KEYS[1]).status_code == 200
    assert httpx.get(guarded.url + "/v1/models", timeout=PATIENCE_SECONDS).status_code == 401
    for open_path in ("/health", "/ready", "/metrics"):
        assert httpx.get(guarded.url + open_path, timeout=PATIENCE_SECONDS).status_code == 200
    client = openai.OpenAI(base_url=guarded.url + "/v1", api_key=KEYS[0], max_retries=0)
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}]
    )
    assert reply.choices[0].message.content == "fine"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=guarded.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_replicas_see_the_gateway_credentials_not_the_clients(
    guarded: GatewayProcess, replica: FaultServer
) -> None:
    before = len(replica.seen)
    assert _post(guarded, _chat(), key=KEYS[0]).status_code == 200
    (request,) = replica.seen[before:]
    assert request.headers["authorization"] == f"Bearer {UPSTREAM_KEY}"
    # Probes carry it too: vLLM started with --api-key guards /v1/models.
    assert replica.probe_headers["authorization"] == f"Bearer {UPSTREAM_KEY}"


@pytest.mark.parametrize(("forward", "expected"), [(False, None), (True, "Bearer client-key")])
def test_client_authorization_is_dropped_unless_forwarding_is_asked_for(
    forward: bool, expected: str | None
) -> None:
    with FaultServer() as recorder:
        args = ["--forward-client-auth"] if forward else []
        with GatewayProcess([f"{MODEL}={recorder.url}"], *args) as gateway:
            assert _post(gateway, _chat(), key="client-key").status_code == 200
    assert recorder.seen[0].headers.get("authorization") == expected


def test_oversized_headers_get_431_and_do_not_grow_the_process(guarded: GatewayProcess) -> None:
    big = httpx.post(
        guarded.url + "/v1/chat/completions",
        content=_chat(),
        headers={"authorization": f"Bearer {KEYS[0]}", "x-padding": "a" * 10_000},
        timeout=PATIENCE_SECONDS,
    )
    assert big.status_code == 431 and _error(big)["code"] == "headers_too_large"
    before = rss_bytes(guarded.pid)
    # 64 MB of headers, streamed: refused after the first few kilobytes, connection closed.
    with socket.create_connection(("127.0.0.1", guarded.port)) as raw:
        raw.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
        sent = 0
        with pytest.raises(OSError):  # the server closes the connection while we send
            for index in range(1000):
                raw.sendall(b"x-%d: %s\r\n" % (index, b"b" * 65536))
                sent += 65536
        reply = raw.recv(65536)
    assert reply.startswith(b"HTTP/1.1 431 ")
    assert sent < 8 * 2**20
    assert rss_bytes(guarded.pid) - before < 4 * 2**20


def test_malformed_http_gets_an_openai_400(guarded: GatewayProcess) -> None:
    with socket.create_connection(("127.0.0.1", guarded.port)) as raw:
        raw.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nbad header line\r\n\r\n")
        reply = _read_response(raw)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ")
    assert orjson.loads(body)["error"]["code"] == "invalid_http"


def test_deeply_nested_json_gets_400(guarded: GatewayProcess) -> None:
    shallow = _chat(metadata={"a": [[[{"b": [1]}]]]})
    assert _post(guarded, shallow).status_code == 200
    deep = _chat(metadata=orjson.loads(b"[" * 40 + b"]" * 40))
    response = _post(guarded, deep)
    assert response.status_code == 400 and _error(response)["code"] == "too_deep"
    # Long conversations hold many brackets without being deep.
    many = orjson.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": f"m{n}"} for n in range(50)]}
    )
    assert _post(guarded, many).status_code == 200


def test_body_limits(guarded: GatewayProcess) -> None:
    large = _post(guarded, _chat("x" * 200_000))
    assert large.status_code == 413 and _error(large)["code"] == "body_too_large"
    # A body that never finishes arriving is cut off after the body timeout (2 s here).
    with socket.create_connection(("127.0.0.1", guarded.port), timeout=30) as raw:
        raw.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n"
            b"authorization: Bearer " + KEYS[0].encode() + b'\r\n\r\n{"model"'
        )
        began = time.monotonic()
        reply = _read_response(raw)
        waited = time.monotonic() - began
    assert reply.startswith(b"HTTP/1.1 408 ")
    assert waited > 1.9  # not before the timeout
    assert b'"code":"body_timeout"' in reply


def _read_response(raw: socket.socket) -> bytes:
    """One whole response with a Content-Length, however the bytes arrive."""
    reply = raw.recv(65536)
    while b"\r\n\r\n" not in reply:
        reply += raw.recv(65536)
    head, _, body = reply.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(body) < length:
        body += raw.recv(65536)
    return head + b"\r\n\r\n" + body


def test_prompts_and_answers_never_reach_logs_or_metrics(
    guarded: GatewayProcess, replica: FaultServer
) -> None:
    marker = f"secret-{uuid.uuid4().hex}"
    answer = f"answer-{uuid.uuid4().hex}"
    usual, replica.answer = replica.answer, answer
    bodies = [
        _chat(f"{marker} plain"),
        _chat(f"{marker} streamed", stream=True),
        _chat(f"{marker} unknown model").replace(MODEL.encode(), b"no-such-model"),
        b'{"model": "' + MODEL.encode() + b'", "messages": [' + marker.encode() + b"]",
        _chat(marker, metadata=orjson.loads(b"[" * 40 + b"]" * 40)),
        _chat(marker, messages_extra=marker),
        _chat(marker * 5000),
    ]
    statuses = [_post(guarded, body).status_code for body in bodies]
    assert statuses == [200, 200, 404, 400, 400, 200, 413]
    replica.mode = "error"  # errors and failures get logged too
    try:
        assert _post(guarded, _chat(f"{marker} failing")).status_code == 500
    finally:
        replica.mode, replica.answer = "ok", usual
    assert marker in replica.seen[-1].body.decode()  # it did go through the gateway
    metrics = guarded.metrics()
    assert metric_value(metrics, "gateway_requests_total") > 0
    assert marker not in metrics
    wait_until(lambda: '"request_id"' in guarded.log(), "the access log written")
    log = guarded.log()
    assert marker not in log  # ... without the prompt
    assert answer not in log  # nor the answer
