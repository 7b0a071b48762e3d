"""End to end: a request whose prefix is still being computed on its replica waits for it.

One emulated replica with a slow prefill (a 2,000-token system prompt takes about 0.4 s) whose
first tokens the tests hold back while they need a prefill in progress, the gateway on a real
port, the official `openai` client streaming. The second request, sent while the first is in
prefill, finds the system prompt cached when it is held — and computes it a
second time when it is not (`--prefill-wait 0`). The backend's pending prefill, which the
policy reads, counts a request's prompt from its routing to its first byte, and a client that
hangs up before then takes its count away with it.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator

import httpx
import openai
import orjson
import pytest

from prefix_gateway.emulator.replicas import EmulatedReplicas
from tests.conftest import MODEL
from tests.fault_servers import FaultServer
from tests.support import GatewayProcess, metric_value, stall, wait_until
from tests.test_feedback_pruning import admitted
from tests.words import words

SYSTEM_TOKENS = 2000
# The tests hold first tokens back on purpose: not a stall to act on.
NO_STALLS = ("--stall-seconds", "600")


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


def two_requests_in_one_prefill(
    gateway: GatewayProcess,
    fleet: EmulatedReplicas,
    second_arrived: Callable[[], bool],
    second_gateway: GatewayProcess | None = None,
    first_announced: Callable[[], bool] = lambda: True,
) -> tuple[int, int]:
    """Cached tokens of a first request and of a second with the same system prompt, sent
    (through `second_gateway`, if given) once the first is on the replica and
    `first_announced()`, while the first is still in prefill (its replica holds its first
    token until `second_arrived()`)."""
    clients = {
        name: openai.OpenAI(base_url=through.url + "/v1", api_key="unused", max_retries=0)
        for name, through in (("first", gateway), ("second", second_gateway or gateway))
    }
    try:
        return _in_one_prefill(clients, fleet, second_arrived, first_announced)
    finally:
        for client in clients.values():
            client.close()


def _in_one_prefill(
    clients: dict[str, openai.OpenAI],
    fleet: EmulatedReplicas,
    second_arrived: Callable[[], bool],
    first_announced: Callable[[], bool],
) -> tuple[int, int]:
    for client in clients.values():  # connections open, client loaded
        streamed_cached_tokens(client, words(10, "warm"), "up")
    replica = fleet.replicas[0]
    system = words(SYSTEM_TOKENS, "sys")
    results: dict[str, int] = {}

    def ask(name: str) -> threading.Thread:
        def run() -> None:
            results[name] = streamed_cached_tokens(clients[name], system, words(20, name))

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    stall(replica, True)
    try:
        first = ask("first")
        wait_until(
            lambda: replica.metric("vllm:num_requests_running") == 1, "the first on the replica"
        )
        wait_until(first_announced, "the first request's prefill announced")
        second = ask("second")
        wait_until(second_arrived, "the second request where it waits")
    finally:
        stall(replica, False)
    first.join(60)
    second.join(60)
    return results["first"], results["second"]


def test_a_request_waits_for_its_prefix_in_prefill(replica: EmulatedReplicas) -> None:
    # A wait no busy machine outlasts: the test releases the prefill.
    with GatewayProcess(replica.urls, "--prefill-wait", "60", *NO_STALLS) as gateway:
        admitted(gateway, 1)

        def held_by_the_gateway() -> bool:
            return gateway.metric("gateway_backend_in_flight") == 2

        first, second = two_requests_in_one_prefill(gateway, replica, held_by_the_gateway)
        text = gateway.metrics()
    assert first == 0
    assert second >= SYSTEM_TOKENS - 16  # the whole system prompt, to the engine's block
    assert metric_value(text, "gateway_prefill_waits_total", outcome="computed") == 1
    assert metric_value(text, "gateway_prefill_wait_seconds_count") == 1


def test_without_waiting_the_prefix_is_computed_twice(replica: EmulatedReplicas) -> None:
    with GatewayProcess(replica.urls, "--prefill-wait", "0", *NO_STALLS) as gateway:
        admitted(gateway, 1)
        engine = replica.replicas[0]

        def on_the_replica() -> bool:
            return engine.metric("vllm:num_requests_running") == 2

        first, second = two_requests_in_one_prefill(gateway, replica, on_the_replica)
        text = gateway.metrics()
    assert (first, second) == (0, 0)
    assert metric_value(text, "gateway_prefill_waits_total") == 0


def pending_prefill(gateway: GatewayProcess) -> int:
    backends = httpx.get(gateway.url + "/admin/backends", timeout=5).json()["data"]
    return sum(int(backend["pending_prefill_blocks"]) for backend in backends)


def test_pending_prefill_counts_a_prompt_until_its_first_byte(replica: EmulatedReplicas) -> None:
    with GatewayProcess(replica.urls, *NO_STALLS) as gateway:
        client = openai.OpenAI(
            base_url=admitted(gateway, 1).url + "/v1", api_key="unused", max_retries=0
        )
        streamed_cached_tokens(client, words(10, "warm"), "up")
        assert pending_prefill(gateway) == 0
        system = words(SYSTEM_TOKENS, "pending")
        engine = replica.replicas[0]
        thread = threading.Thread(
            target=streamed_cached_tokens, args=(client, system, words(20, "q"))
        )
        stall(engine, True)  # no first byte until released
        try:
            thread.start()
            wait_until(
                lambda: engine.metric("vllm:num_requests_running") == 1, "the request in prefill"
            )
            during = pending_prefill(gateway)
            gauge_during = metric_value(gateway.metrics(), "gateway_backend_pending_prefill_blocks")
        finally:
            stall(engine, False)
        thread.join(60)
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
            wait_until(lambda: replica.stalled == 1, "the request on the replica")
            assert pending_prefill(gateway) > 0
        wait_until(lambda: pending_prefill(gateway) == 0, "the pending prefill taken back")
