"""The load bound through a live gateway: concurrent requests sharing one hot system prompt
spread over the replicas, none of which ever carries more than the bound.

Every stream is held open (slow decoding) until all of them run at once, so the replicas'
own counts of running requests are the loads the policy placed.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx

from prefix_gateway.emulator.replicas import EmulatedReplicas
from prefix_gateway.routing.ring import load_bound
from tests.conftest import MODEL
from tests.support import GatewayProcess, eventually, wait_until
from tests.words import words

REPLICAS = 4
CONCURRENT = 24
FACTOR, FLOOR = 1.25, 2
# 300 tokens at 200 ms: a minute, far longer than the test holds a stream.
DECODE = ["--decode-ms-per-token", "200"]


def body(system: str, user: int) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": f"question {user}: {words(8, f'q{user}')}"},
        ],
        "max_tokens": 300,
        "stream": True,
    }


async def hold_streams(gateway: GatewayProcess, fleet: EmulatedReplicas) -> list[str]:
    """Opens the streams one after another, each once the last has its first chunk; returns
    their route labels after checking the loads with every stream running."""
    system = words(400, "hot")
    routes: list[str] = []
    limits = httpx.Limits(max_connections=CONCURRENT)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        held = []
        try:
            for user in range(CONCURRENT):
                request = client.build_request(
                    "POST", gateway.url + "/v1/chat/completions", json=body(system, user)
                )
                response = await client.send(request, stream=True)
                assert response.status_code == 200
                lines = response.aiter_lines()  # kept: collected, it would close the stream
                held.append((response, lines))
                while not (await anext(lines)).startswith("data: {"):
                    pass
                routes.append(response.headers["x-gateway-route"])
            running = [replica.metric("vllm:num_requests_running") for replica in fleet.replicas]
            assert sum(running) == CONCURRENT
            bound = load_bound(CONCURRENT - 1, REPLICAS, FACTOR, FLOOR)
            assert max(running) <= bound, (running, bound)
            gateway_loads = [
                gateway.metric("gateway_backend_in_flight", backend=url.removeprefix("http://"))
                for url in fleet.urls
            ]
            assert gateway_loads == running
        finally:
            for response, _ in held:
                await response.aclose()
    await eventually(
        lambda: gateway.metric("gateway_backend_in_flight") == 0, "every stream released"
    )
    return routes


def test_a_hot_prefix_spreads_within_the_load_bound_through_the_overflow_route() -> None:
    args = ("--load-factor", str(FACTOR), "--load-floor", str(FLOOR))
    with (
        EmulatedReplicas(REPLICAS, MODEL, DECODE) as fleet,
        GatewayProcess(fleet.urls, *args) as gateway,
    ):
        wait_until(
            lambda: gateway.metric("gateway_backend_healthy") == REPLICAS, "every replica healthy"
        )
        before = gateway.metric("gateway_load_bound_overflows_total", model=MODEL)
        routes = Counter(asyncio.run(hold_streams(gateway, fleet)))
        overflows = gateway.metric("gateway_load_bound_overflows_total", model=MODEL) - before
    # The prompt's holders filled up to the bound; the rest spilled over, each spill counted.
    assert routes["overflow"] > 0, routes
    assert overflows == routes["overflow"]
    assert set(routes) <= {"hash", "prefix", "overflow"}, routes
