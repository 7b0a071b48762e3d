"""Sticky sessions across gateways: the cookie the gateway issues, and sessions that must move.

Two gateways with `--sticky-cookie` share one Redis in front of two emulated replicas; a
browser-like client keeps whatever cookie it was given and talks to either gateway.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from gateway.backends import Backend, BackendPool
from gateway.config import Settings
from gateway.fleet import EmulatedFleet
from gateway.index import InMemoryPrefixIndex
from gateway.metrics import Metrics
from gateway.parsing import Endpoint, parse_request
from gateway.policy import Route, build_policy
from gateway.router import Router
from gateway.sessions import InMemorySessionStore
from tests.conftest import MODEL
from tests.redis_server import RedisServer
from tests.support import GatewayProcess, metric_value
from tests.test_redis_fleet import PATIENT
from tests.words import words

COOKIE = "pgw-session"


Pair = tuple[RedisServer, EmulatedFleet, list[GatewayProcess]]


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    with RedisServer() as redis, EmulatedFleet(2, MODEL, ["--chat-template", "plain"]) as fleet:
        gateways: list[GatewayProcess] = []
        try:
            for _ in range(2):
                gateway = GatewayProcess(
                    fleet.urls, "--redis-url", redis.url, *PATIENT, "--sticky-cookie", COOKIE
                )
                gateways.append(gateway.start())
            yield redis, fleet, gateways
        finally:
            for gateway in gateways:
                gateway.stop()


def sessions_in(redis: RedisServer) -> int:
    return len(redis.cli("--scan", "--pattern", "pgw:s:*").split())


def wait_for_sessions(redis: RedisServer, count: int) -> None:
    """Session writes reach Redis behind the response: wait until they have landed."""
    deadline = time.monotonic() + 5
    while sessions_in(redis) < count:
        assert time.monotonic() < deadline, "the session never reached Redis"
        time.sleep(0.01)


def ask(gateway: GatewayProcess, client: httpx.Client, tag: str) -> httpx.Response:
    response = client.post(
        gateway.url + "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": words(20, tag)}],
            "max_tokens": 2,
        },
        timeout=10,
    )
    assert response.status_code == 200
    return response


def test_the_cookie_is_issued_once_and_then_acts_as_the_session_key(pair: Pair) -> None:
    redis, _, gateways = pair
    known = sessions_in(redis)
    with httpx.Client() as browser:
        first = ask(gateways[0], browser, "ck0")
        assert "HttpOnly" in first.headers["set-cookie"]
        assert browser.cookies.get(COOKIE)
        wait_for_sessions(redis, known + 1)
        for attempt in range(1, 5):
            again = ask(gateways[attempt % 2], browser, f"ck{attempt}")
            assert "set-cookie" not in again.headers
            assert again.headers["x-gateway-backend"] == first.headers["x-gateway-backend"]
            assert again.headers["x-gateway-route"] == "session"
    with httpx.Client() as stranger:
        other = ask(gateways[1], stranger, "ck9")
        assert other.cookies.get(COOKIE) not in (None, browser.cookies.get(COOKIE))


def test_a_session_whose_backend_dies_moves_once_and_sticks_again(pair: Pair) -> None:
    redis, fleet, gateways = pair
    known = sessions_in(redis)
    with httpx.Client() as browser:
        bound = ask(gateways[0], browser, "mv0").headers["x-gateway-backend"]
        wait_for_sessions(redis, known + 1)
        doomed = next(replica for replica in fleet.replicas if replica.url.endswith(bound))
        doomed.kill()
        deadline = time.monotonic() + 10
        while gateways[1].metric("gateway_backend_healthy", backend=bound) != 0:
            assert time.monotonic() < deadline, "the dead replica was never ejected"
            time.sleep(0.05)
        moved = ask(gateways[1], browser, "mv1")
        assert moved.headers["x-gateway-backend"] != bound
        assert metric_value(gateways[1].metrics(), "gateway_session_moves_total") == 1
        assert gateways[1].metric("gateway_session_moves_total", cause="unhealthy") == 1
        for attempt in range(2, 5):
            again = ask(gateways[attempt % 2], browser, f"mv{attempt}")
            assert again.headers["x-gateway-backend"] == moved.headers["x-gateway-backend"]
            assert again.headers["x-gateway-route"] == "session"


def test_a_session_over_the_load_bound_moves_and_is_bound_again() -> None:
    settings = Settings(backend=("a:1", "b:2"), load_floor=2)
    pool = BackendPool()
    for name in ("a:1", "b:2"):
        pool.add(Backend(name, f"http://{name}", frozenset({MODEL}), healthy=True))
    metrics = Metrics()
    sessions = InMemorySessionStore(600, 100)
    router = Router(
        settings,
        pool,
        InMemoryPrefixIndex(600, 1000),
        sessions,
        build_policy(settings),
        metrics,
    )
    body = f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "hi"}}]}}'
    request = parse_request(Endpoint.CHAT, body.encode(), "s-1")

    async def scenario() -> None:
        await sessions.put("s-1", "a:1")
        busy = pool.get("a:1")
        assert busy is not None
        busy.in_flight = 5
        routed = await router.route(request)
        assert routed.backend.name == "b:2" and routed.route is not Route.SESSION
        assert await sessions.get("s-1") == "b:2"
        busy.in_flight = 0
        assert (await router.route(request)).route is Route.SESSION

    asyncio.run(scenario())
    text = metrics.render().decode()
    assert metric_value(text, "gateway_session_moves_total", cause="load_bound") == 1
    assert metric_value(text, "gateway_session_moves_total") == 1
