"""The admin API open on loopback without a token answers this machine, not a page in its
browser: a foreign `Host` (DNS rebinding) or a foreign `Origin` (a cross-site form) is refused
and changes nothing. Its bodies are bounded before they are read. And the control plane
echoes no `Host` in a redirect and serves no page that loads scripts from a CDN.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import orjson
import pytest

from prefix_gateway.auth import host_name, is_loopback
from prefix_gateway.emulator.replicas import EmulatedReplicas
from tests.conftest import MODEL
from tests.support import GatewayProcess

MAX_BODY = 100_000


@pytest.fixture(scope="module")
def replicas() -> Iterator[EmulatedReplicas]:
    with EmulatedReplicas(2, MODEL, ["--chat-template", "plain"]) as started:
        yield started


@pytest.fixture(scope="module")
def gateway(replicas: EmulatedReplicas) -> Iterator[GatewayProcess]:
    # One replica at first: the tests add the second.
    args = ("--max-body-bytes", str(MAX_BODY))
    with GatewayProcess(replicas.urls[:1], *args) as started:
        yield started


def _names(gateway: GatewayProcess) -> list[str]:
    listing = httpx.get(gateway.url + "/admin/backends", timeout=30).json()["data"]
    return sorted(item["name"] for item in listing)


def _add(gateway: GatewayProcess, url: str, **headers: str) -> httpx.Response:
    return httpx.post(
        gateway.url + "/admin/backends", json={"url": url}, headers=headers, timeout=30
    )


def refused(answer: httpx.Response, code: str) -> str:
    """The message of the admin API's refusal `answer`, a 403 with `code` and nothing else."""
    assert answer.status_code == 403, answer.text
    body = answer.json()
    assert list(body) == ["error"]
    error = body["error"]
    assert (error["type"], error["code"]) == ("permission_error", code)
    message: str = error["message"]
    return message


def test_loopback_hosts() -> None:
    for host in ("localhost", "LOCALHOST:8080", "127.0.0.1", "127.3.2.1:80", "[::1]:8080", "::1"):
        assert is_loopback(host_name(host)), host
    for host in ("rebind.evil.example", "evil.example:8080", "10.0.0.1", "[2001:db8::1]:80", ""):
        assert not is_loopback(host_name(host)), host


def test_a_foreign_host_is_refused_and_changes_nothing(
    gateway: GatewayProcess, replicas: EmulatedReplicas
) -> None:
    before = _names(gateway)
    added = _add(gateway, replicas.urls[1], host="rebind.evil.example")
    listed = httpx.get(
        gateway.url + "/admin/backends", headers={"host": "rebind.evil.example:80"}, timeout=30
    )
    refusal = "the admin API answers only requests addressed to a loopback host, not"
    assert refused(added, "foreign_host") == f"{refusal} 'rebind.evil.example'"
    # Not even the list of backends is answered.
    assert refused(listed, "foreign_host") == f"{refusal} 'rebind.evil.example:80'"
    assert _names(gateway) == before


def test_a_foreign_origin_is_refused_and_changes_nothing(
    gateway: GatewayProcess, replicas: EmulatedReplicas
) -> None:
    before = _names(gateway)
    drained = httpx.post(
        gateway.url + f"/admin/backends/{before[0]}/drain",
        headers={"origin": "https://evil.example"},
        timeout=30,
    )
    sandboxed = _add(gateway, replicas.urls[1], origin="null")
    refusal = "the admin API answers no request sent by a page from another origin"
    assert refused(drained, "foreign_origin") == f"{refusal} ('https://evil.example')"
    assert refused(sandboxed, "foreign_origin") == f"{refusal} ('null')"
    assert _names(gateway) == before
    assert all(item["draining"] is False for item in _listing(gateway))


def _listing(gateway: GatewayProcess) -> list[dict[str, object]]:
    data: list[dict[str, object]] = httpx.get(gateway.url + "/admin/backends", timeout=30).json()[
        "data"
    ]
    return data


def test_a_loopback_host_and_origin_work(
    gateway: GatewayProcess, replicas: EmulatedReplicas
) -> None:
    origin = f"http://localhost:{gateway.port}"
    url = replicas.urls[1]
    name = url.removeprefix("http://")
    added = _add(gateway, url, host=f"127.0.0.1:{gateway.port}", origin=origin)
    try:
        assert added.status_code == 201, added.text
        backend = added.json()
        assert (backend["name"], backend["url"], backend["source"]) == (name, url, "admin")
        assert backend["models"] == [MODEL] and backend["draining"] is False
        assert backend == next(item for item in _listing(gateway) if item["name"] == name)
    finally:
        removed = httpx.delete(gateway.url + f"/admin/backends/{name}", timeout=30)
    assert removed.status_code == 200
    assert removed.json() == {**backend, "removed": True}
    assert name not in _names(gateway)


def test_an_oversized_explain_body_is_refused_before_it_is_read(gateway: GatewayProcess) -> None:
    size = 300 * 1024 * 1024
    with socket.create_connection(("127.0.0.1", gateway.port)) as raw:
        raw.settimeout(30)
        head = b"POST /admin/explain HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: %d\r\n\r\n"
        raw.sendall(head % size + b"{" * 1000)
        answer = b""
        while chunk := raw.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413 "), answer
    error = orjson.loads(answer.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == "body_too_large"
    assert error["message"] == f"request body exceeds the limit of {MAX_BODY} bytes"
    assert b"connection: close" in answer.lower()


def test_a_chunked_explain_body_over_the_limit_is_refused(gateway: GatewayProcess) -> None:
    def chunks() -> Iterator[bytes]:
        for _ in range(MAX_BODY // 10_000 + 2):
            yield b" " * 10_000

    answer = httpx.post(gateway.url + "/admin/explain", content=chunks(), timeout=30)
    assert answer.status_code == 413
    error = answer.json()["error"]
    assert error["code"] == "body_too_large"
    assert error["message"] == f"request body exceeds the limit of {MAX_BODY} bytes"


def test_explain_still_explains(gateway: GatewayProcess) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}
    answer = httpx.post(gateway.url + "/admin/explain", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    explained = answer.json()
    assert (explained["model"], explained["endpoint"]) == (MODEL, "/v1/chat/completions")
    assert explained["backend"] in _names(gateway)
    assert explained["route"] and explained["reason"]


def test_a_trailing_slash_is_a_404_without_a_location(gateway: GatewayProcess) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    answer = httpx.post(
        gateway.url + "/v1/chat/completions/",
        json=body,
        headers={"host": "evil.example"},
        timeout=30,
    )
    assert answer.status_code == 404 and "location" not in answer.headers
    assert answer.json()["error"]["code"] == "http_404"
    assert b"evil.example" not in answer.content


def test_no_docs_page_and_the_schema_stays(gateway: GatewayProcess) -> None:
    for page in ("/docs", "/redoc"):
        answer = httpx.get(gateway.url + page, timeout=30)
        assert answer.status_code == 404
        assert answer.headers["content-type"] == "application/json"
        assert answer.json()["error"]["code"] == "http_404"
    schema = httpx.get(gateway.url + "/openapi.json", timeout=30)
    assert schema.status_code == 200 and "/v1/chat/completions" in schema.json()["paths"]
