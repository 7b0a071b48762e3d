"""End to end: a request whose prefix is still being computed on its replica waits for it.

One emulated replica with a slow prefill (a 2,000-token system prompt takes about 0.4 s), the
gateway on a real port, the official `openai` client streaming. The second request, sent while
the first is in prefill, finds the system prompt cached when it is held — and computes it a
second time when it is not (`--prefill-wait 0`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import openai
import pytest

from gateway.fleet import EmulatedFleet
from tests.conftest import MODEL
from tests.support import GatewayProcess, metric_value
from tests.test_feedback_pruning import admitted
from tests.words import words

SYSTEM_TOKENS = 2000


@pytest.fixture
def replica() -> Iterator[EmulatedFleet]:
    args = ["--chat-template", "plain", "--prefill-us-per-token", "200"]
    with EmulatedFleet(1, MODEL, args) as started:
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


def test_a_request_waits_for_its_prefix_in_prefill(replica: EmulatedFleet) -> None:
    with GatewayProcess(replica.urls) as gateway:
        admitted_gateway = admitted(gateway, 1)
        first, second = two_requests_at_once(admitted_gateway)
        text = gateway.metrics()
    assert first == 0
    assert second >= SYSTEM_TOKENS - 16  # the whole system prompt, to the engine's block
    assert metric_value(text, "gateway_prefill_waits_total", outcome="computed") == 1
    assert metric_value(text, "gateway_prefill_wait_seconds_count") == 1


def test_without_waiting_the_prefix_is_computed_twice(replica: EmulatedFleet) -> None:
    with GatewayProcess(replica.urls, "--prefill-wait", "0") as gateway:
        first, second = two_requests_at_once(admitted(gateway, 1))
        text = gateway.metrics()
    assert (first, second) == (0, 0)
    assert metric_value(text, "gateway_prefill_waits_total") == 0
