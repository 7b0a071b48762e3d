"""Redis dies under load and comes back: no client request fails, and sharing resumes.

Three gateways share one redis-server in front of four emulated replicas while a bounded
client keeps conversations going across all three. The server is killed (SIGKILL, everything
it held is lost) and started again on the same port.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from gateway.fleet import EmulatedFleet
from tests.conftest import MODEL
from tests.redis_server import RedisServer
from tests.support import GatewayProcess
from tests.test_redis_fleet import PATIENT
from tests.words import words

GATEWAYS = 3
WORKERS = 6


@dataclass
class Outcome:
    answered: int = 0
    failures: list[str] = field(default_factory=list)


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


async def converse(
    client: httpx.AsyncClient,
    gateways: list[GatewayProcess],
    worker: int,
    stop: asyncio.Event,
    outcome: Outcome,
) -> None:
    """Conversations of four turns, each turn on the next gateway, until told to stop."""
    conversation = 0
    while not stop.is_set():
        conversation += 1
        tag = f"w{worker}c{conversation}"
        messages = [{"role": "system", "content": words(200, tag + "s")}]
        for turn in range(4):
            messages.append({"role": "user", "content": words(30, f"{tag}q{turn}")})
            gateway = gateways[(worker + turn) % GATEWAYS]
            try:
                response = await client.post(
                    gateway.url + "/v1/chat/completions",
                    json={"model": MODEL, "messages": messages, "max_tokens": 20},
                )
            except httpx.HTTPError as error:
                outcome.failures.append(f"{gateway.url}: {error!r}")
                continue
            if response.status_code != 200:
                outcome.failures.append(f"{gateway.url}: {response.status_code} {response.text}")
                continue
            outcome.answered += 1
            answer = response.json()["choices"][0]["message"]["content"]
            messages.append({"role": "assistant", "content": answer})


def wait_until(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def total(gateways: list[GatewayProcess], name: str, **labels: str) -> float:
    return sum(gateway.metric(name, **labels) for gateway in gateways)


def test_killing_redis_under_load_fails_no_request_and_sharing_resumes(
    gateways: list[GatewayProcess], redis_server: RedisServer
) -> None:
    wait_until(lambda: total(gateways, "gateway_redis_up") == GATEWAYS)
    outcome = Outcome()

    async def load() -> None:
        stop = asyncio.Event()
        limits = httpx.Limits(max_connections=WORKERS)
        async with httpx.AsyncClient(timeout=30, limits=limits) as client:
            workers = [
                asyncio.create_task(converse(client, gateways, worker, stop, outcome))
                for worker in range(WORKERS)
            ]
            await asyncio.sleep(1.0)
            answered_before = outcome.answered
            redis_server.kill()
            await asyncio.sleep(1.5)
            assert outcome.answered > answered_before  # served on while Redis was gone
            redis_server.start()
            await asyncio.sleep(1.5)
            stop.set()
            await asyncio.gather(*workers)

    asyncio.run(load())
    assert outcome.failures == []
    assert outcome.answered > 50
    assert total(gateways, "gateway_redis_errors_total") > 0
    assert total(gateways, "gateway_redis_fallbacks_total", operation="match") > 0
    wait_until(lambda: total(gateways, "gateway_redis_up") == GATEWAYS)

    # Sharing is back: a conversation begun now is continued by gateways that never saw it.
    messages = [{"role": "system", "content": words(1000, "after-s")}]
    served: list[str] = []
    routes: list[str] = []
    computed: list[int] = []
    for turn in range(6):
        messages.append({"role": "user", "content": words(100, f"after-q{turn}")})
        response = httpx.post(
            gateways[turn % GATEWAYS].url + "/v1/chat/completions",
            json={"model": MODEL, "messages": messages, "max_tokens": 300},
            timeout=30,
        )
        assert response.status_code == 200
        served.append(response.headers["x-gateway-backend"])
        routes.append(response.headers["x-gateway-route"])
        usage = response.json()["usage"]
        computed.append(usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"])
        messages.append(
            {"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]}
        )
    assert served == [served[0]] * 6
    assert routes[1:] == ["prefix"] * 5
    assert computed == [1100, 108, 108, 108, 108, 108]
