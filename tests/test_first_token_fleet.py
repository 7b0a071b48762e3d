"""Three gateways on one Redis in front of an uneven fleet: each learns each replica's time to
first token from the streams it relays (the fits are not shared) and each moves new prompts off
the slow replica."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from itertools import count, cycle
from typing import Any

import httpx
import openai
import pytest

from prefix_gateway.emulator.replicas import EmulatedReplicas
from tests.redis_server import PATIENT, RedisServer
from tests.support import PATIENCE_SECONDS, GatewayProcess, wait_until
from tests.words import words

# Beside another worker's tests, its gateways' time to first token is mostly that load's.
pytestmark = [pytest.mark.fleet, pytest.mark.alone]

MODEL = "emulated-model"
AUTH = {"authorization": "Bearer t"}


@pytest.fixture(scope="module")
def fleet() -> Iterator[EmulatedReplicas]:
    # 0.5 ms a token: a 1,200-token prompt takes 0.6 s, 1.8 s on the first replica, slowed.
    args = ["--prefill-us-per-token", "500", "--cache-blocks", "4096"]
    with EmulatedReplicas(2, MODEL, args) as replicas:
        response = httpx.post(
            replicas.urls[0] + "/emulator/slowdown", json={"factor": 3}, timeout=PATIENCE_SECONDS
        )
        assert response.status_code == 200
        yield replicas


@pytest.fixture(scope="module")
def gateways(fleet: EmulatedReplicas) -> Iterator[list[GatewayProcess]]:
    with RedisServer() as redis, ExitStack() as stack:
        yield [
            stack.enter_context(
                GatewayProcess(
                    fleet.urls,
                    "--redis-url",
                    redis.url,
                    *PATIENT,
                    "--admin-token",
                    "t",
                    "--ttft-routing",
                    # Each gateway sees a third of these sparse streams: a longer memory keeps
                    # it from trying the slow replica again between two of its observations.
                    "--ttft-half-life",
                    "20",
                )
            )
            for _ in range(3)
        ]


def _stream(gateway: GatewayProcess, prompt: str) -> str:
    """`prompt` streamed through `gateway`; the replica that answered it."""
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=2, stream=True
    )
    for _ in stream.parse():
        pass
    return stream.headers["x-gateway-backend"]


def _explain(gateway: GatewayProcess, prompt: str) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "stream": True}
    response = httpx.post(
        gateway.url + "/admin/explain", json=body, headers=AUTH, timeout=PATIENCE_SECONDS
    )
    assert response.status_code == 200, response.text
    explained: dict[str, Any] = response.json()
    return explained


def _slow_name(gateway: GatewayProcess, fleet: EmulatedReplicas) -> str:
    listed = httpx.get(
        gateway.url + "/admin/backends", headers=AUTH, timeout=PATIENCE_SECONDS
    ).json()["data"]
    return next(str(item["name"]) for item in listed if item["url"] == fleet.urls[0])


def test_each_gateway_learns_the_slow_replica_and_moves_new_prompts_off_it(
    fleet: EmulatedReplicas, gateways: list[GatewayProcess]
) -> None:
    slow = _slow_name(gateways[0], fleet)
    numbers = count()
    turns = cycle(gateways)

    def mostly_elsewhere() -> bool:
        # New prompts through the three gateways in turn: at most 3 of 12 on the slow replica
        # (half of them with the replicas alike).
        served = [_stream(next(turns), words(1200, f"f{next(numbers):04d}")) for _ in range(12)]
        return served.count(slow) <= 3

    wait_until(mostly_elsewhere, "new prompts to leave the slow replica", seconds=120)
    # Each gateway predicts from its own fit, taught by the streams it relays itself: each
    # comes to see the slow replica slower, and places a new prompt elsewhere.
    for gateway in gateways:

        def sees_it_slower(gateway: GatewayProcess = gateway) -> bool:
            _stream(gateway, words(1200, f"g{next(numbers):04d}"))
            predicted = _predicted(gateway)
            return predicted[slow] > 1.5 * min(predicted.values())

        wait_until(sees_it_slower, "every gateway to predict the slow replica slower")
        explained = _explain(gateway, words(1200, "fleetx"))
        assert explained["backend"] != slow


def _predicted(gateway: GatewayProcess) -> dict[str, float]:
    """Each candidate's predicted time to first token (ms) for a new 1,200-word prompt."""
    explained = _explain(gateway, words(1200, "fleetx"))
    predicted = {c["backend"]: c["predicted_ttft_ms"] for c in explained["candidates"]}
    assert None not in predicted.values(), explained
    return predicted
