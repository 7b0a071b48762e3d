"""A fleet of gateways sharing one Redis: any gateway continues what another one started.

Three gateway processes share one redis-server in front of four emulated replicas; the turns of
each conversation go to the gateways in rotation, as a Kubernetes Service would spread them.
Two more gateways issue sticky cookies. Two tests break the fleet and mend it before they end:
one kills a replica (a session must move) and starts it again, one kills Redis under load and
starts it again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import openai
import pytest

from prefix_gateway.backends.backend import Backend
from prefix_gateway.backends.pool import BackendPool
from prefix_gateway.config import Settings
from prefix_gateway.emulator.replicas import EmulatedReplicas
from prefix_gateway.metrics import Metrics
from prefix_gateway.prompt.parsing import Endpoint, parse_request, session_hash
from prefix_gateway.routing.policies import Route, build_policy
from prefix_gateway.routing.recorder import Stores
from prefix_gateway.routing.router import Router
from prefix_gateway.state.index import InMemoryPrefixIndex
from prefix_gateway.state.sessions import InMemorySessionStore
from tests.conftest import MODEL
from tests.redis_server import PATIENT, RedisServer
from tests.support import (
    PATIENCE_SECONDS,
    GatewayProcess,
    eventually,
    metric_value,
    start_together,
    wait_until,
)
from tests.words import words

pytestmark = pytest.mark.fleet

GATEWAYS = 3
COOKIE = "pgw-session"


@dataclass
class Fleet:
    redis: RedisServer
    replicas: EmulatedReplicas
    gateways: list[GatewayProcess]
    """Three gateways in rotation."""
    cookie_gateways: list[GatewayProcess]
    """Two gateways with --sticky-cookie."""

    @property
    def every_gateway(self) -> list[GatewayProcess]:
        return [*self.gateways, *self.cookie_gateways]


@pytest.fixture(scope="module")
def shared(fleet: EmulatedReplicas) -> Iterator[Fleet]:
    with RedisServer() as redis:
        started = [
            GatewayProcess(fleet.urls, "--redis-url", redis.url, *PATIENT, *extra)
            for extra in [()] * GATEWAYS + [("--sticky-cookie", COOKIE)] * 2
        ]
        start_together(started)
        try:
            yield Fleet(redis, fleet, started[:GATEWAYS], started[GATEWAYS:])
        finally:
            for gateway in started:
                gateway.stop()


def sessions_in(redis: RedisServer) -> int:
    return len(redis.cli("--scan", "--pattern", "pgw:s:*").split())


def ask(gateway: GatewayProcess, client: httpx.Client, tag: str, **headers: str) -> httpx.Response:
    response = client.post(
        gateway.url + "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": words(20, tag)}],
            "max_tokens": 2,
        },
        headers=headers,
        timeout=10,
    )
    assert response.status_code == 200
    return response


def converse_in_rotation(gateways: list[GatewayProcess], tag: str, first: int = 0) -> list[str]:
    """Six turns of the lesson's conversation, turn n on gateway first + n; the routes taken.

    Every turn is served by turn 1's replica, and turn n ≥ 2 computes only its new 108 tokens.
    """
    messages: list[dict[str, str]] = [{"role": "system", "content": words(1000, tag + "s")}]
    served: list[str] = []
    routes: list[str] = []
    computed: list[int] = []
    with contextlib.ExitStack() as stack:
        rotation = [
            stack.enter_context(
                openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
            )
            for gateway in gateways
        ]
        for turn in range(6):
            client = rotation[(first + turn) % len(rotation)]
            messages.append({"role": "user", "content": words(100, f"{tag}q{turn}")})
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
            answer = reply.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": answer})
    assert served == [served[0]] * 6
    assert computed == [1100, 108, 108, 108, 108, 108]
    return routes


def test_turns_spread_over_gateways_stay_on_the_first_turns_replica(shared: Fleet) -> None:
    for conversation in range(3):
        routes = converse_in_rotation(shared.gateways, f"rf{conversation}", conversation)
        # Each later turn reached a gateway that had never seen the conversation: only the
        # shared index can have told it where the history is.
        assert routes[1:] == ["owner"] * 5


def test_a_session_bound_on_one_gateway_sticks_on_the_others(shared: Fleet) -> None:
    known = sessions_in(shared.redis)
    seen: list[tuple[str, str]] = []
    with httpx.Client(timeout=PATIENCE_SECONDS) as client:
        for attempt in range(6):
            gateway = shared.gateways[attempt % GATEWAYS]
            response = ask(gateway, client, f"rs{attempt}", **{"x-session-id": "fleet-7"})
            seen.append(
                (response.headers["x-gateway-backend"], response.headers["x-gateway-route"])
            )
            if attempt == 0:
                # The binding reaches Redis behind the response; a human's next turn comes later.
                wait_until(lambda: sessions_in(shared.redis) > known, "the binding in Redis")
    assert len({backend for backend, _ in seen}) == 1, seen
    assert [route for _, route in seen[1:]] == ["session"] * 5, seen


def test_a_session_binding_in_redis_expires(shared: Fleet) -> None:
    def bindings() -> set[str]:
        return set(shared.redis.cli("--scan", "--pattern", "pgw:s:*").split())

    known = bindings()
    with httpx.Client(timeout=PATIENCE_SECONDS) as client:
        ask(shared.gateways[0], client, "ttl", **{"x-session-id": "expiring"})
    wait_until(lambda: bindings() - known, "the binding in Redis")
    (key,) = bindings() - known
    # It expires with the affinity TTL (600 s), and was written with it.
    assert 0 < int(shared.redis.cli("pttl", key)) <= 600_000


def test_the_cookie_is_issued_once_and_then_acts_as_the_session_key(shared: Fleet) -> None:
    known = sessions_in(shared.redis)
    with httpx.Client(timeout=PATIENCE_SECONDS) as browser:
        first = ask(shared.cookie_gateways[0], browser, "ck0")
        assert "HttpOnly" in first.headers["set-cookie"]
        issued = browser.cookies.get(COOKIE)
        assert issued
        wait_until(lambda: sessions_in(shared.redis) > known, "the binding in Redis")
        for attempt in range(1, 5):
            again = ask(shared.cookie_gateways[attempt % 2], browser, f"ck{attempt}")
            assert "set-cookie" not in again.headers
            assert again.headers["x-gateway-backend"] == first.headers["x-gateway-backend"]
            assert again.headers["x-gateway-route"] == "session"
    with httpx.Client(timeout=PATIENCE_SECONDS) as stranger:
        other = ask(shared.cookie_gateways[1], stranger, "ck9")
        assert other.cookies.get(COOKIE) not in (None, issued)


def test_a_session_whose_backend_dies_moves_once_and_sticks_again(shared: Fleet) -> None:
    gateways = shared.cookie_gateways
    known = sessions_in(shared.redis)

    def moves(**cause: str) -> float:
        return gateways[1].metric("gateway_session_moves_total", **cause)

    moves_before, unhealthy_before = moves(), moves(cause="unhealthy")
    with httpx.Client(timeout=PATIENCE_SECONDS) as browser:
        bound = ask(gateways[0], browser, "mv0").headers["x-gateway-backend"]
        wait_until(lambda: sessions_in(shared.redis) > known, "the binding in Redis")
        doomed = next(
            replica for replica in shared.replicas.replicas if replica.url.endswith(bound)
        )
        doomed.kill()
        try:
            wait_until(
                lambda: gateways[1].metric("gateway_backend_healthy", backend=bound) == 0,
                "the dead replica ejected",
            )
            moved = ask(gateways[1], browser, "mv1")
            assert moved.headers["x-gateway-backend"] != bound
            assert moves() - moves_before == 1
            assert moves(cause="unhealthy") - unhealthy_before == 1
            for attempt in range(2, 5):
                again = ask(gateways[attempt % 2], browser, f"mv{attempt}")
                assert again.headers["x-gateway-backend"] == moved.headers["x-gateway-backend"]
                assert again.headers["x-gateway-route"] == "session"
        finally:
            doomed.start()  # on its port again, for the tests after this one
            wait_until(
                lambda: all(
                    gateway.metric("gateway_backend_healthy", backend=bound) == 1
                    for gateway in shared.every_gateway
                ),
                "the replica back in every gateway",
            )


def test_a_session_over_the_load_bound_moves_and_is_bound_again() -> None:
    settings = Settings(backend=("a:1", "b:2"), load_floor=2)
    pool = BackendPool()
    for name in ("a:1", "b:2"):
        pool.add(Backend(name, f"http://{name}", frozenset({MODEL}), healthy=True))
    metrics = Metrics()
    sessions = InMemorySessionStore(600, 100)
    index = InMemoryPrefixIndex(600, 1000)
    router = Router(settings, pool, Stores(index, sessions), build_policy(settings), metrics)
    body = f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "hi"}}]}}'
    request = parse_request(Endpoint.CHAT, body.encode(), "s-1")

    async def scenario() -> None:
        assert request.session_key == session_hash("s-1")  # what the store is keyed by
        await sessions.put(session_hash("s-1"), "a:1")
        busy = pool.get("a:1")
        assert busy is not None
        for _ in range(5):
            busy.leased()
        routed = await router.route(request)
        assert routed.backend.name == "b:2" and routed.decision.route is not Route.SESSION
        assert await sessions.get(session_hash("s-1")) == "b:2"
        for _ in range(5):
            busy.released()
        assert (await router.route(request)).decision.route is Route.SESSION

    asyncio.run(scenario())
    text = metrics.render().decode()
    assert metric_value(text, "gateway_session_moves_total", cause="load_bound") == 1
    assert metric_value(text, "gateway_session_moves_total") == 1


@dataclass
class Outcome:
    answered: int = 0
    failures: list[str] = field(default_factory=list)


async def keep_conversing(
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
            gateway = gateways[(worker + turn) % len(gateways)]
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


def test_killing_redis_under_load_fails_no_request_and_sharing_resumes(shared: Fleet) -> None:
    gateways = shared.gateways

    def total(name: str, **labels: str) -> float:
        return sum(gateway.metric(name, **labels) for gateway in gateways)

    wait_until(lambda: total("gateway_redis_up") == GATEWAYS, "every gateway on Redis")
    outcome = Outcome()

    async def load(workers: int = 6) -> None:
        stop = asyncio.Event()
        async with httpx.AsyncClient(
            timeout=30, limits=httpx.Limits(max_connections=workers)
        ) as client:
            running = [
                asyncio.create_task(keep_conversing(client, gateways, worker, stop, outcome))
                for worker in range(workers)
            ]
            await eventually(lambda: outcome.answered >= 20, "requests answered")
            answered_before = outcome.answered
            shared.redis.kill()  # SIGKILL: everything it held is lost
            await eventually(
                lambda: outcome.answered >= answered_before + 20,
                "requests served on while Redis is gone",
            )
            answered_without = outcome.answered
            shared.redis.start()  # the same port, empty
            await eventually(
                lambda: outcome.answered >= answered_without + 20,
                "requests served once Redis is back",
            )
            stop.set()
            await asyncio.gather(*running)

    asyncio.run(load())
    assert outcome.failures == []
    assert outcome.answered > 50
    assert total("gateway_redis_errors_total") > 0
    assert total("gateway_redis_fallbacks_total", operation="match") > 0
    wait_until(
        lambda: (
            sum(gateway.metric("gateway_redis_up") for gateway in shared.every_gateway)
            == len(shared.every_gateway)
        ),
        "every gateway on Redis",
    )
    # Sharing is back: a conversation begun now is continued by gateways that never saw it.
    assert converse_in_rotation(gateways, "after")[1:] == ["owner"] * 5
