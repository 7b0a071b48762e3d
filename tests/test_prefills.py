"""End to end: a request whose prefix is still being computed on its replica waits for it.

One emulated replica with a slow prefill (a 2,000-token system prompt takes about 0.4 s), the
gateway on a real port, the official `openai` client streaming. The second request, sent while
the first is in prefill, finds the system prompt cached when it is held — and computes it a
second time when it is not (`--prefill-wait 0`). The backend's pending prefill, which the
policy reads, counts a request's prompt from its routing to its first byte, and a client that
hangs up before then takes its count away with it.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import orjson
import pytest

from gateway.emulator.replicas import EmulatedReplicas
from tests.conftest import MODEL
from tests.fault_servers import FaultServer
from tests.support import GatewayProcess, metric_value
from tests.test_feedback_pruning import admitted
from tests.words import words

SYSTEM_TOKENS = 2000


@pytest.fixture
def replica() -> Iterator[EmulatedReplicas]:
    args = ["--chat-template", "plain", "--prefill-us-per-token", "200"]
    with EmulatedReplicas(1, MODEL, args) as started:
        yield started


def streamed_cached_tokens(client: openai.OpenAI, system: str, question: str) -> int:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    cached = -1
    for chunk in stream:
        if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens or 0
    return cached


def two_requests_at_once(gateway: GatewayProcess) -> tuple[int, int]:
    """Cached tokens of a first request and of a second sent 0.1 s later, same system prompt
    (in the order the replica computed them)."""
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    streamed_cached_tokens(client, words(10, "warm"), "up")  # connections open, client loaded
    system = words(SYSTEM_TOKENS, "sys")
    results: dict[str, int] = {}

    def first() -> None:
        results["first"] = streamed_cached_tokens(client, system, words(20, "q1"))

    thread = threading.Thread(target=first)
    thread.start()
    time.sleep(0.1)
    results["second"] = streamed_cached_tokens(client, system, words(20, "q2"))
    thread.join(10)
    earlier, later = sorted((results["first"], results["second"]))
    return earlier, later


def test_a_request_waits_for_its_prefix_in_prefill(replica: EmulatedReplicas) -> None:
    with GatewayProcess(replica.urls) as gateway:
        admitted_gateway = admitted(gateway, 1)
        first, second = two_requests_at_once(admitted_gateway)
        text = gateway.metrics()
    assert first == 0
    assert second >= SYSTEM_TOKENS - 16  # the whole system prompt, to the engine's block
    assert metric_value(text, "gateway_prefill_waits_total", outcome="computed") == 1
    assert metric_value(text, "gateway_prefill_wait_seconds_count") == 1


def test_without_waiting_the_prefix_is_computed_twice(replica: EmulatedReplicas) -> None:
    with GatewayProcess(replica.urls, "--prefill-wait", "0") as gateway:
        first, second = two_requests_at_once(admitted(gateway, 1))
        text = gateway.metrics()
    assert (first, second) == (0, 0)
    assert metric_value(text, "gateway_prefill_waits_total") == 0


def pending_prefill(gateway: GatewayProcess) -> int:
    backends = httpx.get(gateway.url + "/admin/backends", timeout=5).json()["data"]
    return sum(int(backend["pending_prefill_blocks"]) for backend in backends)


def test_pending_prefill_counts_a_prompt_until_its_first_byte(replica: EmulatedReplicas) -> None:
    with GatewayProcess(replica.urls) as gateway:
        client = openai.OpenAI(
            base_url=admitted(gateway, 1).url + "/v1", api_key="unused", max_retries=0
        )
        streamed_cached_tokens(client, words(10, "warm"), "up")
        assert pending_prefill(gateway) == 0
        system = words(SYSTEM_TOKENS, "pending")
        thread = threading.Thread(
            target=streamed_cached_tokens, args=(client, system, words(20, "q"))
        )
        thread.start()
        time.sleep(0.15)
        during = pending_prefill(gateway)
        gauge_during = metric_value(gateway.metrics(), "gateway_backend_pending_prefill_blocks")
        thread.join(10)
        after = pending_prefill(gateway)
        gauge_after = metric_value(gateway.metrics(), "gateway_backend_pending_prefill_blocks")
    # The whole prompt, in the gateway's blocks (a block is several characters of text).
    assert during > 0 and gauge_during == during
    assert after == 0 and gauge_after == 0


def test_a_client_gone_before_the_first_byte_leaves_no_pending_prefill() -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": words(200, "gone")}],
        "max_tokens": 4,
        "stream": True,
    }
    payload = orjson.dumps(body)
    with (
        FaultServer() as replica,
        GatewayProcess([f"{MODEL}={replica.url}"]) as gateway,
    ):
        admitted(gateway, 1)
        replica.mode = "stall"  # no first byte ever: only the hang-up can end the request
        # A raw socket: an HTTP client would wait for the response's headers, which come
        # with the first byte.
        with socket.create_connection((gateway.host, gateway.port), timeout=5) as connection:
            connection.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\n"
                b"content-type: application/json\r\n"
                + f"content-length: {len(payload)}\r\n\r\n".encode()
                + payload
            )
            deadline = time.monotonic() + 5
            while replica.stalled == 0:
                assert time.monotonic() < deadline, "the request never reached the replica"
                time.sleep(0.02)
            assert pending_prefill(gateway) > 0
        deadline = time.monotonic() + 5
        while pending_prefill(gateway) != 0:
            assert time.monotonic() < deadline, "the pending prefill was never taken back"
            time.sleep(0.05)
