"""A client that hangs up while still sending its request body: nothing of it reaches a replica,
the gateway gives back what the body held, and requests beside it are served.

One gateway (module fixture) with one concurrency slot, no queue, and a pending-body budget no
larger than one body: a slot or a single byte of budget kept by a request that is gone would
refuse every later request, or the largest body, with a 429.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import orjson
import pytest

from prefix_gateway.emulator.replicas import EmulatedReplicas
from tests.conftest import MODEL
from tests.support import PATIENCE_SECONDS, GatewayProcess, metric_value, wait_until

MAX_BODY = 100_000
SENT = 10_240
"""Body bytes sent before hanging up."""
BESIDE = 3
"""Requests served while the half-sent body is open."""
AFTER = 5
"""Requests sent one after another once it is gone."""


@dataclass(frozen=True)
class HangUp:
    framing: str
    """`content-length` (100,000 declared) or `chunked`."""
    sent: int
    reset: bool
    """Hang up with a TCP reset rather than a close."""

    def head(self) -> bytes:
        length = b"content-length: %d" % MAX_BODY
        framing = length if self.framing == "content-length" else b"transfer-encoding: chunked"
        return (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
            b"content-type: application/json\r\n" + framing + b"\r\n\r\n"
        )

    def body(self) -> bytes:
        start = b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "'
        data = (start + b"a" * self.sent)[: self.sent]
        if self.framing == "chunked" and data:
            return b"%x\r\n" % len(data) + data + b"\r\n"  # the last chunk never comes
        return data


CASES = [
    HangUp("content-length", SENT, reset=False),
    HangUp("content-length", 0, reset=False),
    HangUp("chunked", SENT, reset=True),
]


@pytest.fixture(scope="module")
def replicas() -> Iterator[EmulatedReplicas]:
    with EmulatedReplicas(2, MODEL) as started:
        yield started


@pytest.fixture(scope="module")
def gateway(replicas: EmulatedReplicas) -> Iterator[GatewayProcess]:
    args = ["--max-concurrency", "1", "--max-queue", "0", "--max-body-bytes", str(MAX_BODY)]
    args += ["--max-pending-body-bytes", str(MAX_BODY)]
    with GatewayProcess(replicas.urls, *args) as started:
        yield started


def _chat(gateway: GatewayProcess, size: int = 0) -> httpx.Response:
    """A chat request; with `size`, its body padded to exactly `size` bytes."""
    body = _chat_body("p" * (size - len(_chat_body(""))) if size else "hi")
    assert not size or len(body) == size
    return httpx.post(
        gateway.url + "/v1/chat/completions",
        content=body,
        headers={"content-type": "application/json"},
        timeout=30,
    )


def _chat_body(content: str) -> bytes:
    messages = [{"role": "user", "content": content}]
    return orjson.dumps({"model": MODEL, "messages": messages, "max_tokens": 1})


def _answered(gateway: GatewayProcess) -> float:
    """Requests the gateway forwarded and had answered, all replicas and statuses together."""
    return metric_value(gateway.metrics(), "gateway_requests_total")


def _hung_up(gateway: GatewayProcess) -> float:
    return metric_value(gateway.metrics(), "gateway_rejected_requests_total", code="disconnected")


def _finished(replicas: EmulatedReplicas) -> float:
    """Requests the replicas' engines ran to their end, whatever the reason."""
    return sum(replica.metric("vllm:request_success_total") for replica in replicas.replicas)


@pytest.mark.parametrize(
    "hang_up", CASES, ids=[f"{c.framing}-{c.sent}-{'reset' if c.reset else 'close'}" for c in CASES]
)
def test_a_client_hanging_up_mid_body_leaves_nothing_behind(
    gateway: GatewayProcess, replicas: EmulatedReplicas, hang_up: HangUp
) -> None:
    answered, finished, hung_up = _answered(gateway), _finished(replicas), _hung_up(gateway)
    raw = socket.create_connection(("127.0.0.1", gateway.port))
    try:
        raw.sendall(hang_up.head() + hang_up.body())
        # The half-sent body holds no slot: the one slot serves the requests beside it.
        for _ in range(BESIDE):
            assert _chat(gateway).status_code == 200
    finally:
        if hang_up.reset:
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        raw.close()
    wait_until(lambda: _hung_up(gateway) == hung_up + 1, "the gateway saw the client hang up")

    # What the body held is back: a body as large as the whole budget fits, and the one slot
    # serves every request after it.
    assert _chat(gateway, size=MAX_BODY).status_code == 200
    for _ in range(AFTER):
        assert _chat(gateway).status_code == 200
    assert httpx.get(gateway.url + "/health", timeout=PATIENCE_SECONDS).status_code == 200
    assert httpx.get(gateway.url + "/ready", timeout=PATIENCE_SECONDS).status_code == 200

    # Nothing of it went upstream: the gateway and the replicas count only the others.
    served = BESIDE + 1 + AFTER
    wait_until(lambda: _answered(gateway) >= answered + served, "the gateway counted them")
    wait_until(lambda: _finished(replicas) >= finished + served, "the replicas counted them")
    assert _answered(gateway) == answered + served
    assert _finished(replicas) == finished + served
    assert _hung_up(gateway) == hung_up + 1
