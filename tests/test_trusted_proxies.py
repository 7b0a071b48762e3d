"""What a replica is told of the client (`--trusted-proxies`), read at a replica that records its
requests: the `X-Forwarded-For` chain the client sent with the connection's peer appended (every
hop kept), and an `X-Forwarded-Proto` that is the client's claim only when the peer is a
trusted proxy. The per-client connection cap counts peers whatever the headers say: a
connection is counted before its first byte (docs/deploy.md).

The gateway is reached from two loopback addresses: 127.0.0.1, which some settings trust, and
127.0.0.2, which none does.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import orjson
import pytest

from tests.conftest import MODEL
from tests.fault_servers import FaultServer
from tests.support import GatewayProcess, read_to_close, wait_until

PROXY = "127.0.0.1"
STRANGER = "127.0.0.2"
CLIENT = "203.0.113.7"
"""The address the proxy says it got the request from."""
PER_CLIENT = 2

TRUST = {
    "unset": (),
    "another-proxy": ("--trusted-proxies", "192.0.2.1"),
    "the-proxy": ("--trusted-proxies", PROXY),
    # 127.0.0.0/31 holds the proxy, not the stranger.
    "a-network-of-the-proxy": (
        "--trusted-proxies",
        "192.0.2.1",
        "--trusted-proxies",
        "127.0.0.0/31",
    ),
}
TRUSTS_THE_PROXY = {"the-proxy", "a-network-of-the-proxy"}


@pytest.fixture(scope="module")
def replica() -> Iterator[FaultServer]:
    with FaultServer() as server:
        yield server


@pytest.fixture(scope="module", params=list(TRUST))
def trust(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture(scope="module")
def gateway(replica: FaultServer, trust: str) -> Iterator[GatewayProcess]:
    args = (*TRUST[trust], "--max-connections-per-client", str(PER_CLIENT))
    # The held requests of the cap test wait for their bodies as long as the test needs.
    args += ("--body-timeout", "120")
    with GatewayProcess([f"{MODEL}={replica.url}"], *args) as started:
        yield started


def _body() -> bytes:
    messages = [{"role": "user", "content": "hi"}]
    return orjson.dumps({"model": MODEL, "messages": messages, "max_tokens": 1})


def _served(gateway: GatewayProcess, source: str) -> bool:
    """Whether a request from `source` is answered (not refused at its connection)."""
    transport = httpx.HTTPTransport(local_address=source)
    try:
        with httpx.Client(transport=transport, timeout=30) as client:
            reply = client.post(gateway.url + "/v1/chat/completions", content=_body())
    except httpx.HTTPError:
        return False
    return reply.status_code == 200


def _forwarded(
    gateway: GatewayProcess, replica: FaultServer, source: str, **headers: str
) -> tuple[list[str], str]:
    """The `X-Forwarded-For` chain and `X-Forwarded-Proto` the replica got for a request sent
    from `source`."""
    transport = httpx.HTTPTransport(local_address=source)
    with httpx.Client(transport=transport, timeout=30) as client:
        before = len(replica.seen)
        reply = client.post(gateway.url + "/v1/chat/completions", content=_body(), headers=headers)
        assert reply.status_code == 200, reply.text
    (seen,) = replica.seen[before:]
    return seen.headers["x-forwarded-for"].split(", "), seen.headers["x-forwarded-proto"]


def test_the_peer_is_appended_and_only_a_trusted_proxy_names_the_scheme(
    gateway: GatewayProcess, replica: FaultServer, trust: str
) -> None:
    claims = {"x-forwarded-for": CLIENT, "x-forwarded-proto": "https"}
    from_proxy = _forwarded(gateway, replica, PROXY, **claims)
    from_stranger = _forwarded(gateway, replica, STRANGER, **claims)
    plain = _forwarded(gateway, replica, PROXY)
    # The chain the client sent is kept and the hop that reached the gateway appended, once.
    assert from_proxy[0] == [CLIENT, PROXY]
    assert from_stranger[0] == [CLIENT, STRANGER]
    assert plain[0] == [PROXY]
    # The scheme is the connection's unless a trusted proxy says otherwise.
    assert from_proxy[1] == ("https" if trust in TRUSTS_THE_PROXY else "http")
    assert from_stranger[1] == "http"
    assert plain[1] == "http"


def test_the_connection_cap_counts_the_peer_whatever_it_forwards(
    gateway: GatewayProcess, replica: FaultServer, trust: str
) -> None:
    body = _body()
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
    head += b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body)
    clients = [f"198.51.100.{number}" for number in range(1, PER_CLIENT + 1)]
    held = []
    try:
        # Requests under way, each forwarded for another client, hold the peer's connections.
        for client in clients:
            raw = socket.create_connection((PROXY, gateway.port), timeout=30)
            held.append(raw)
            raw.sendall(head + b"x-forwarded-for: " + client.encode() + b"\r\n\r\n" + body[:5])
        with socket.create_connection((PROXY, gateway.port), timeout=30) as extra:
            refused = read_to_close(extra)
        before = len(replica.seen)
        answers = []
        for raw in held:
            raw.sendall(body[5:])
            answers.append(read_to_close(raw))
    finally:
        for raw in held:
            raw.close()
    assert refused.startswith(b"HTTP/1.1 429 "), refused[:200]
    error = orjson.loads(refused.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == "too_many_client_connections"
    assert all(answer.startswith(b"HTTP/1.1 200 ") for answer in answers), answers
    chains = sorted(seen.headers["x-forwarded-for"] for seen in replica.seen[before:])
    assert chains == [f"{client}, {PROXY}" for client in clients]
    # Once they are closed the peer is served again.
    wait_until(lambda: _served(gateway, PROXY), "the closed connections are no longer counted")
