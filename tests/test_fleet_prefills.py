"""End to end: in a fleet, a request waits for its shared prompt being computed on its replica
by another gateway's stream, as it waits for one of its own gateway's (`tests/test_prefills.py`).

One emulated replica with a slow prefill whose first tokens the test holds back, two gateways
on a redis-server of the test's own, the official `openai` client streaming: the first request
through one gateway, the second through the other while the first is in prefill. Told where
the fleet's streams compute (`--fleet-share` with `prefills`, the default), the second gateway
holds its request until the first's prefill is over and it finds the system prompt cached;
without, it computes the system prompt a second time.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from prefix_gateway.emulator.replicas import EmulatedReplicas
from tests.conftest import MODEL
from tests.redis_server import PATIENT, RedisServer
from tests.support import GatewayProcess, metric_value
from tests.test_feedback_pruning import admitted
from tests.test_prefills import NO_STALLS, SYSTEM_TOKENS, two_requests_in_one_prefill

pytestmark = pytest.mark.fleet

# A wait no busy machine outlasts: the test releases the prefill.
WAITING = ("--prefill-wait", "60", *NO_STALLS, *PATIENT)


@pytest.fixture
def replica() -> Iterator[EmulatedReplicas]:
    args = ["--chat-template", "plain", "--prefill-us-per-token", "200"]
    with EmulatedReplicas(1, MODEL, args) as started:
        yield started


def prefill_calls(gateway: GatewayProcess) -> float:
    """Redis calls the gateway made about prefills in progress, announcements and polls."""
    return gateway.metric("gateway_redis_operation_seconds_count", operation="prefill")


def test_a_request_waits_for_another_gateways_stream_computing_its_prompt(
    replica: EmulatedReplicas,
) -> None:
    with (
        RedisServer() as redis,
        GatewayProcess(replica.urls, "--redis-url", redis.url, *WAITING) as first,
        GatewayProcess(replica.urls, "--redis-url", redis.url, *WAITING) as second,
    ):
        admitted(first, 1)
        admitted(second, 1)
        announced = prefill_calls(first)  # the warm-up's own announcement and its end
        cached = two_requests_in_one_prefill(
            first,
            replica,
            # Asked once, and again after a poll that still found the first computing.
            lambda: prefill_calls(second) >= 2,
            second_gateway=second,
            first_announced=lambda: prefill_calls(first) > announced,
        )
        text = second.metrics()
    assert cached[0] == 0
    assert cached[1] >= SYSTEM_TOKENS - 16  # the whole system prompt, to the engine's block
    assert metric_value(text, "gateway_prefill_waits_total", outcome="computed") == 1
    assert metric_value(text, "gateway_redis_fallbacks_total") == 0


def test_without_sharing_prefills_the_other_gateway_computes_it_again(
    replica: EmulatedReplicas,
) -> None:
    alone = ("--fleet-share", "claims", "--fleet-share", "traffic", "--fleet-share", "prompts")
    with (
        RedisServer() as redis,
        GatewayProcess(replica.urls, "--redis-url", redis.url, *WAITING, *alone) as first,
        GatewayProcess(replica.urls, "--redis-url", redis.url, *WAITING, *alone) as second,
    ):
        admitted(first, 1)
        admitted(second, 1)
        engine = replica.replicas[0]
        cached = two_requests_in_one_prefill(
            first,
            replica,
            lambda: engine.metric("vllm:num_requests_running") == 2,
            second_gateway=second,
        )
        text = second.metrics()
        assert prefill_calls(first) == prefill_calls(second) == 0
    assert cached == (0, 0)
    assert metric_value(text, "gateway_prefill_waits_total") == 0
