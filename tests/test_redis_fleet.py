"""A fleet of gateways sharing one Redis: any gateway continues what another one started.

Three gateway processes share one redis-server in front of four emulated replicas; the turns
of each conversation go to the gateways in rotation, as a Kubernetes Service would spread them.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from gateway.fleet import EmulatedFleet
from tests.conftest import MODEL
from tests.redis_server import RedisServer
from tests.support import GatewayProcess
from tests.words import words

GATEWAYS = 3
# These tests are about sharing, not deadlines (test_redis_store.py checks those): a deadline
# well above loopback latency keeps a busy test machine from turning a lookup into a fallback.
PATIENT = ("--redis-timeout", "0.5")


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def gateways(fleet: EmulatedFleet, redis_server: RedisServer) -> Iterator[list[GatewayProcess]]:
    started: list[GatewayProcess] = []
    try:
        for _ in range(GATEWAYS):
            started.append(
                GatewayProcess(fleet.urls, "--redis-url", redis_server.url, *PATIENT).start()
            )
        yield started
    finally:
        for gateway in started:
            gateway.stop()


def clients(gateways: list[GatewayProcess]) -> list[openai.OpenAI]:
    return [
        openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
        for gateway in gateways
    ]


def test_turns_spread_over_gateways_stay_on_the_first_turns_replica(
    gateways: list[GatewayProcess],
) -> None:
    rotation = clients(gateways)
    for conversation in range(3):
        messages: list[dict[str, str]] = [
            {"role": "system", "content": words(1000, f"rf{conversation}s")}
        ]
        served: list[str] = []
        routes: list[str] = []
        computed: list[int] = []
        for turn in range(6):
            client = rotation[(conversation + turn) % GATEWAYS]
            messages.append({"role": "user", "content": words(100, f"rf{conversation}q{turn}")})
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=300,
            )
            reply = raw.parse()
            served.append(raw.headers["x-gateway-backend"])
            routes.append(raw.headers["x-gateway-route"])
            assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
            cached = reply.usage.prompt_tokens_details.cached_tokens or 0
            computed.append(reply.usage.prompt_tokens - cached)
            messages.append(
                {"role": "assistant", "content": reply.choices[0].message.content or ""}
            )
        assert served == [served[0]] * 6
        # Each later turn reached a gateway that had never seen the conversation: only the
        # shared index can have told it where the history is.
        assert routes[1:] == ["prefix"] * 5
        assert computed == [1100, 108, 108, 108, 108, 108]


def test_a_session_bound_on_one_gateway_sticks_on_the_others(
    gateways: list[GatewayProcess],
) -> None:
    seen: list[tuple[str, str]] = []
    for attempt in range(6):
        gateway = gateways[attempt % GATEWAYS]
        response = httpx.post(
            gateway.url + "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": words(20, f"rs{attempt}")}],
                "max_tokens": 2,
            },
            headers={"x-session-id": "fleet-session-7"},
            timeout=10,
        )
        assert response.status_code == 200
        seen.append((response.headers["x-gateway-backend"], response.headers["x-gateway-route"]))
    backends = {backend for backend, _ in seen}
    assert len(backends) == 1
    assert [route for _, route in seen[1:]] == ["session"] * 5
