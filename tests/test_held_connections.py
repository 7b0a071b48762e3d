"""Connections held without a key: an answer given before the body was read closes the
connection, a body that stops arriving is closed on the server's own timer, and one client
address cannot take every connection (`--max-connections-per-client`).

All through raw sockets on loopback; the attacker of the per-client cap connects from
127.0.0.2, so that the normal client on 127.0.0.1 is another address.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import BinaryIO

import httpx
import openai
import orjson
import pytest

from prefix_gateway.emulator.replicas import EmulatedReplicas
from tests.conftest import MODEL
from tests.support import GatewayProcess, read_to_close, wait_until

KEY = "client-key"
PER_CLIENT = 4
ATTACKER = "127.0.0.2"


@pytest.fixture(scope="module")
def replica() -> Iterator[EmulatedReplicas]:
    with EmulatedReplicas(1, MODEL, ["--chat-template", "plain"]) as started:
        yield started


@pytest.fixture(scope="module")
def keyed(replica: EmulatedReplicas) -> Iterator[GatewayProcess]:
    args = ("--api-key", KEY, "--body-timeout", "2", "--max-connections-per-client", "0")
    with GatewayProcess(replica.urls, *args) as gateway:
        yield gateway


def _connect(gateway: GatewayProcess, source: str = "127.0.0.1") -> socket.socket:
    raw = socket.create_connection(("127.0.0.1", gateway.port), source_address=(source, 0))
    raw.settimeout(30)
    return raw


def _read_answer(reader: BinaryIO) -> bytes:
    """One answer with a `content-length` from `raw.makefile("rb")`, the connection left open."""
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        line = reader.readline()
        assert line, f"closed before the end of a head: {head!r}"
        head += line
    length = int(head.lower().partition(b"content-length: ")[2].partition(b"\r\n")[0])
    return head + reader.read(length)


def _send_more(raw: socket.socket, data: bytes) -> None:
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        raw.sendall(data)  # fails if closed already: what is asserted


def _code(answer: bytes) -> str:
    return str(orjson.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"])


BEARER = f"authorization: Bearer {KEY}\r\n".encode()


@pytest.mark.parametrize(
    ("head", "status", "code"),
    [
        (b"POST /v1/chat/completions HTTP/1.1\r\n", 401, "missing_api_key"),
        (b"PUT /v1/chat/completions HTTP/1.1\r\n" + BEARER, 405, "http_405"),
        (b"POST /nowhere HTTP/1.1\r\n", 404, "http_404"),
        (b"POST /v1/chat/completions HTTP/1.1\r\nvia: 1.1 prefix-gateway\r\n" + BEARER, 508, ""),
    ],
)
def test_an_answer_before_the_body_closes_the_connection(
    keyed: GatewayProcess, head: bytes, status: int, code: str
) -> None:
    with _connect(keyed) as raw, raw.makefile("rb") as reader:
        raw.sendall(head + b"host: x\r\ncontent-length: 100000\r\n\r\n" + b"{" * 10)
        answer = _read_answer(reader)
        # More of the body changes nothing: the connection is closed after the answer.
        _send_more(raw, b"[" * 1000)
        rest = read_to_close(raw)
    assert answer.startswith(b"HTTP/1.1 %d " % status), answer
    assert b"connection: close" in answer.lower()
    if code:
        assert _code(answer) == code
    assert rest == b""


def test_an_answered_request_whose_body_came_whole_keeps_its_connection(
    keyed: GatewayProcess,
) -> None:
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    request = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(
        body
    )
    with _connect(keyed) as raw, raw.makefile("rb") as reader:
        raw.sendall(request + body)
        refused = _read_answer(reader)  # no key: 401, but the body was in whole
        raw.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        health = _read_answer(reader)
    assert refused.startswith(b"HTTP/1.1 401 ") and b"connection: close" not in refused.lower()
    assert health.startswith(b"HTTP/1.1 200 ")


def test_a_control_plane_body_that_stops_is_closed_after_the_body_timeout(
    keyed: GatewayProcess,
) -> None:
    head = b"POST /admin/explain HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: 1000\r\n\r\n"
    with _connect(keyed) as raw:
        raw.sendall(head + b'{"model": ')
        answer = read_to_close(raw)
    assert answer.startswith(b"HTTP/1.1 408 ") and _code(answer) == "body_timeout"
    assert httpx.get(keyed.url + "/health", timeout=30).status_code == 200


def test_a_proxied_body_that_stops_is_closed_after_the_body_timeout(
    keyed: GatewayProcess,
) -> None:
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n"
    with _connect(keyed) as raw:
        raw.sendall(head + BEARER + b"\r\n" + b'{"model": ')
        answer = read_to_close(raw)
    assert answer.startswith(b"HTTP/1.1 408 ") and _code(answer) == "body_timeout"


def test_one_address_cannot_take_every_connection(replica: EmulatedReplicas) -> None:
    args = ("--max-connections-per-client", str(PER_CLIENT), "--head-timeout", "120")
    with GatewayProcess(replica.urls, *args) as gateway:
        held = [_connect(gateway, ATTACKER) for _ in range(PER_CLIENT)]
        with _connect(gateway, ATTACKER) as extra:
            refused = read_to_close(extra)
        # Another address is served meanwhile: the official client and the probes.
        with openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0) as api:
            reply = api.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
        health = httpx.get(gateway.url + "/health", timeout=30)
        for raw in held:
            raw.close()

        def attacker_served_again() -> bool:
            with _connect(gateway, ATTACKER) as raw:
                raw.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
                return read_to_close(raw).startswith(b"HTTP/1.1 200 ")

        wait_until(attacker_served_again, "the closed connections are no longer counted")
    assert refused.startswith(b"HTTP/1.1 429 ")
    assert _code(refused) == "too_many_client_connections"
    assert b"connection: close" in refused.lower()
    assert reply.choices[0].message.content
    assert health.status_code == 200


def test_pipelined_requests_are_answered_in_order_on_one_connection(
    keyed: GatewayProcess,
) -> None:
    body = orjson.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    )
    chat = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n" % len(body)
    health = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
    with _connect(keyed) as raw, raw.makefile("rb") as reader:
        raw.sendall(chat + BEARER + b"\r\n" + body + health + chat + BEARER + b"\r\n" + body)
        answers = [_read_answer(reader) for _ in range(3)]
        raw.sendall(health)
        last = _read_answer(reader)
    assert [answer.split(b" ", 2)[1] for answer in [*answers, last]] == [b"200"] * 4
    assert b'"chat.completion"' in answers[0] and b'"status"' in answers[1]
    assert b'"chat.completion"' in answers[2]
