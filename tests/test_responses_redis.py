"""Stored responses across gateways: two gateways share one real redis-server (started here)
in front of four emulated replicas; a chain of follow-ups alternating between the gateways
must reach, at each step, the replica that stored its predecessor. With Redis gone, a gateway
keeps the chains it saw.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from prefix_gateway.emulator.replicas import EmulatedReplicas
from tests.conftest import MODEL
from tests.redis_server import PATIENT, RedisServer
from tests.support import GatewayProcess, metric_value


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def gateways(fleet: EmulatedReplicas, redis: RedisServer) -> Iterator[list[GatewayProcess]]:
    started: list[GatewayProcess] = []
    try:
        for _ in range(2):
            gateway = GatewayProcess(fleet.urls, "--redis-url", redis.url, *PATIENT)
            started.append(gateway.start())
        yield started
    finally:
        for gateway in started:
            gateway.stop()


def clients(gateways: list[GatewayProcess]) -> list[openai.OpenAI]:
    return [
        openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
        for gateway in gateways
    ]


def create(client: openai.OpenAI, stream: bool, **fields: Any) -> tuple[Any, str]:
    raw = client.responses.with_raw_response.create(
        model=MODEL, max_output_tokens=5, stream=stream, **fields
    )
    backend = raw.headers["x-gateway-backend"]
    if not stream:
        return raw.parse(), backend
    events = list(raw.parse())
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    return events[-1].response, backend


def test_follow_ups_alternating_between_gateways_reach_the_storing_replica(
    gateways: list[GatewayProcess],
) -> None:
    pair = clients(gateways)
    for chain in range(3):
        response, first = create(pair[0], False, input=f"chain {chain}: where is the glue?")
        for turn in range(1, 6):
            # Asked at once at the other gateway, streamed every other time.
            response, backend = create(
                pair[turn % 2],
                turn % 2 == 0,
                previous_response_id=response.id,
                input=f"chain {chain}, turn {turn}",
            )
            assert backend == first, (chain, turn)


def test_response_replicas_are_kept_in_redis_as_hashes_with_a_ttl(
    gateways: list[GatewayProcess], redis: RedisServer
) -> None:
    response, _ = create(clients(gateways)[1], False, input="where is the sandpaper?")
    keys = redis.cli("--scan", "--pattern", "pgw:r:*").split()
    assert keys and all(response.id not in key for key in keys)
    assert all(0 < int(redis.cli("pttl", key)) <= 600_000 for key in keys)
    assert not any(response.id in value for value in redis.cli("mget", *keys).split())


def test_with_redis_gone_a_gateway_keeps_its_own_chains(fleet: EmulatedReplicas) -> None:
    with RedisServer() as lost, GatewayProcess(fleet.urls, "--redis-url", lost.url) as gateway:
        (client,) = clients([gateway])
        before, first = create(client, False, input="where are the screws?")
        lost.kill()
        _, backend = create(client, False, previous_response_id=before.id, input="and?")
        assert backend == first
        started, second = create(client, True, input="where are the bolts?")
        _, backend = create(client, False, previous_response_id=started.id, input="and?")
        assert backend == second
        fallbacks = metric_value(
            gateway.metrics(), "gateway_redis_fallbacks_total", operation="response_put"
        )
        assert fallbacks >= 2
