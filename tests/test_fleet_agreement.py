"""Gateways of a fleet decide as one: the same new prompt lands on the same replica whichever
gateway gets it, and `/admin/explain` says which inputs came from the fleet.

Three gateway processes share one redis-server in front of four emulated replicas whose
prefill is slow (2 ms a token), so a request's prompt is still being computed when the next
request with the same system prompt reaches another gateway.
"""

from __future__ import annotations

import functools
import os
import signal
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from prefix_gateway.backends.backend import Backend
from prefix_gateway.backends.pool import BackendPool
from prefix_gateway.backends.shared_load import FleetLoad, own_counts
from prefix_gateway.clock import ManualClock
from prefix_gateway.config import Settings
from prefix_gateway.emulator.replicas import EmulatedReplicas
from prefix_gateway.routing.traffic import Traffic
from tests.redis_server import PATIENT, RedisServer
from tests.support import GatewayProcess, start_together, wait_until
from tests.words import words

pytestmark = pytest.mark.fleet

MODEL = "fleet-model"
TOKEN = "fleet-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


@dataclass
class Fleet:
    redis: RedisServer
    gateways: list[GatewayProcess]
    alone: GatewayProcess
    """A gateway without Redis: every input its own."""
    apart: GatewayProcess
    """Another gateway without Redis, sharing nothing with `alone`."""


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    slow = ["--chat-template", "plain", "--prefill-us-per-token", "2000"]
    with RedisServer() as redis, EmulatedReplicas(4, MODEL, slow) as replicas:
        # No cap on recent requests: with this little traffic a replica that owns two
        # customers' prompts may count two requests above the mean, and the caps would then
        # pass over it whatever the claim says (tests/test_policy.py covers the caps).
        uncapped = ("--recent-slack", "1000")
        shared = ("--redis-url", redis.url, "--admin-token", TOKEN, *PATIENT, *uncapped)
        started = [GatewayProcess(replicas.urls, *shared) for _ in range(3)]
        alone = GatewayProcess(replicas.urls, "--admin-token", TOKEN, *uncapped)
        apart = GatewayProcess(replicas.urls, *uncapped)
        started += [alone, apart]
        start_together(started)
        try:
            yield Fleet(redis, started[:3], alone, apart)
        finally:
            for gateway in started:
                gateway.stop()


def body(system: str, question: str) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
        "max_tokens": 2,
    }


def explain(gateway: GatewayProcess, request: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(gateway.url + "/admin/explain", json=request, headers=AUTH, timeout=10)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def claimed(gateway: GatewayProcess, request: dict[str, Any]) -> str | None:
    backend: str | None = explain(gateway, request)["inputs"]["claimed_backend"]
    return backend


def send(gateway: GatewayProcess, request: dict[str, Any]) -> httpx.Response:
    return httpx.post(gateway.url + "/v1/chat/completions", json=request, timeout=30)


def test_two_gateways_place_the_same_new_customer_prompt_on_the_same_replica(
    fleet: Fleet,
) -> None:
    first, second = fleet.gateways[0], fleet.gateways[1]
    # Other customers' traffic first: a claim binds a cold prompt (a customer's among many),
    # which the owner rule keeps in one place; a hot one spreads anyway.
    for other in range(12):
        other_prompt = body(words(80, f"o{other}"), words(10, f"p{other}"))
        assert send(fleet.gateways[other % 3], other_prompt).status_code == 200
    with ThreadPoolExecutor(max_workers=1) as pool:
        for customer in range(3):
            system = words(1000, f"s{customer}")
            earlier = body(system, words(40, f"q{customer}"))
            later = body(system, words(40, f"r{customer}"))
            shown = explain(second, later)
            assert shown["route"] == "hash" and shown["inputs"]["claimed_backend"] is None
            computing: Future[httpx.Response] = pool.submit(send, first, earlier)
            # The first request is being prefilled (seconds); its claim is there already.
            wait_until(functools.partial(claimed, second, later), "the claim, at another gateway")
            shown = explain(second, later)
            owner = shown["inputs"]["claimed_backend"]
            depths = {item["backend"]: item["matched_blocks"] for item in shown["candidates"]}
            assert depths[owner] > 0 and sum(depths.values()) == depths[owner]
            assert shown["backend"] == owner
            answered = send(second, later)
            placed = computing.result()
            assert placed.status_code == answered.status_code == 200
            assert placed.headers["x-gateway-route"] == "hash"
            assert answered.headers["x-gateway-route"] in ("owner", "prefix")
            assert answered.headers["x-gateway-backend"] == placed.headers["x-gateway-backend"]
            assert placed.headers["x-gateway-backend"] == owner


def test_explain_says_which_inputs_came_from_the_fleet(fleet: Fleet) -> None:
    request = body(words(1000, "ex"), words(40, "eq"))
    shown = explain(fleet.gateways[2], request)
    inputs = shown["inputs"]
    assert inputs["matched_blocks"] == "fleet"
    assert inputs["claim"] == "fleet"
    assert inputs["prompt_share"] == "fleet"
    assert inputs["sticky_backend"] is None  # no session key
    wait_until(
        lambda: explain(fleet.gateways[2], request)["inputs"]["load"] == "local + fleet",
        "the fleet's load read",
    )
    inputs = explain(fleet.gateways[2], request)["inputs"]
    assert inputs["pending_prefill"] == inputs["recent_requests"] == "local + fleet"
    assert inputs["fleet_exchange_ms_ago"] is not None
    with_key = explain(fleet.gateways[2], {**request, "prompt_cache_key": "explained"})
    assert with_key["inputs"]["sticky_backend"] == "fleet"

    alone = explain(fleet.alone, request)["inputs"]
    assert alone == {
        "matched_blocks": "local",
        "sticky_backend": None,
        "load": "local",
        "pending_prefill": "local",
        "recent_requests": "local",
        "prompt_share": "local",
        "claim": None,
        "claimed_backend": None,
        "fleet_exchange_ms_ago": None,
    }


def test_the_exchange_carries_pending_prefill_and_recent_requests() -> None:
    pool = BackendPool()
    for name in ("a:1", "b:1"):
        pool.add(Backend(name, f"http://{name}", frozenset({MODEL}), healthy=True))
    busy = pool.backends[0]
    busy.leased()
    busy.leased()
    busy.prefill_queued(40)
    line = own_counts(pool, {"a:1": 3.5, "b:1": 1.25}, 4.75)
    assert line == "a:1 2\n~a:1 40 3.500\n~b:1 0 1.250\n~ 4.750\n"
    other = "~a:1 10 1.000\n~ 1.000\n"
    counts = FleetLoad([f"123\n{line}".encode(), f"124\n{other}".encode()])
    assert counts.in_flight == {"a:1": 2}
    assert counts.pending_prefill == {"a:1": 50, "b:1": 0}
    assert counts.recent == {"a:1": 4.5, "b:1": 1.25}
    assert counts.prompts == 5.75
    # A gateway that reads in-flight lines alone: every traffic line carries a decimal point.
    assert FleetLoad([b"1\nc:1 3\n~c:1 0 0.500\n"]).in_flight == {"c:1": 3}


def test_the_fleets_counts_decay_like_the_gateways_own() -> None:
    clock = ManualClock()
    traffic = Traffic(clock, Settings(recent_half_life=10.0))
    traffic.recent.add("a:1")
    traffic.set_fleet({"a:1": 4.0, "b:1": 2.0}, 6.0)
    assert traffic.recent.view["a:1"] == pytest.approx(5.0)
    assert dict(traffic.recent.view) == {"a:1": pytest.approx(5.0), "b:1": pytest.approx(2.0)}
    assert traffic.recent.sum_over(frozenset({"a:1", "b:1"})) == pytest.approx(7.0)
    clock.advance(10.0)
    assert traffic.recent.get("b:1") == pytest.approx(1.0)
    assert traffic.recent.sum_over(frozenset({"a:1", "b:1"})) == pytest.approx(3.5)
    assert traffic.own() == ({"a:1": pytest.approx(0.5)}, 0.0)


def test_a_prompts_share_is_the_fleets_count_over_the_fleets_total() -> None:
    traffic = Traffic(ManualClock(), Settings())
    hashes = list(range(1, 40))
    # Alone: one request, its own prompt's: the whole of it.
    assert traffic.prompt_share(hashes, 30, count=True) == 1.0
    # The fleet saw 9 more requests with other prompts and 2 more with this one.
    traffic.set_fleet({}, 9.0)
    assert traffic.prompt_share(hashes, 30, count=True, fleet_count=4.0) == pytest.approx(4 / 11)
    assert traffic.prompt_share(hashes, 30, count=False, fleet_count=4.0) == pytest.approx(5 / 12)


def depths(shown: dict[str, Any]) -> dict[str, int]:
    return {item["backend"]: item["matched_blocks"] for item in shown["candidates"]}


def test_a_prompt_is_in_the_shared_index_while_its_replica_computes_it(fleet: Fleet) -> None:
    first, second = fleet.gateways[0], fleet.gateways[1]
    # No system prompt: nothing is claimed, only the index can tell the other gateways.
    prompt = {
        "model": MODEL,
        "messages": [{"role": "user", "content": words(1000, "computing")}],
        "max_tokens": 2,
    }
    assert claimed(second, prompt) is None and not any(depths(explain(second, prompt)).values())
    with ThreadPoolExecutor(max_workers=1) as pool:
        computing: Future[httpx.Response] = pool.submit(send, first, prompt)
        # Prefill takes seconds here; the other gateway sees the prompt placed long before.
        wait_until(
            lambda: any(depths(explain(second, prompt)).values()) or computing.done(),
            "the prompt in the shared index, or its answer",
        )
        assert not computing.done(), "the prompt was not shared before its replica answered"
        shown = explain(second, prompt)
        assert shown["inputs"]["claimed_backend"] is None
        placed = computing.result()
    assert placed.status_code == 200
    held = depths(shown)
    backend = placed.headers["x-gateway-backend"]
    assert held[backend] > 0 and sum(held.values()) == held[backend]
    assert shown["backend"] == backend


def test_a_conversations_answer_is_shared_before_its_client_has_it(fleet: Fleet) -> None:
    first, second = fleet.gateways[0], fleet.gateways[1]
    messages = [
        {"role": "system", "content": words(200, "ans")},
        {"role": "user", "content": words(40, "ansq")},
    ]
    request = {"model": MODEL, "messages": messages, "max_tokens": 300}
    before = explain(second, request)
    try:
        response = send(first, request)
        # Frozen the moment its client has the answer: whatever it had not shared by then,
        # it cannot share now.
        os.kill(first.pid, signal.SIGSTOP)
        assert response.status_code == 200
        backend = response.headers["x-gateway-backend"]
        answer = response.json()["choices"][0]["message"]["content"]
        prompt = explain(second, request)
        following = explain(
            second,
            {
                **request,
                "messages": [
                    *messages,
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": words(40, "ansr")},
                ],
            },
        )
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert not any(depths(before).values())
    asked = depths(prompt)[backend]
    # 300 tokens of answer: at least a dozen blocks of 16 tokens past the prompt's.
    assert depths(following)[backend] >= asked + 12
    assert following["backend"] == backend and following["route"] == "owner"


def test_redis_away_leaves_every_input_local(fleet: Fleet) -> None:
    """Last: it kills the module's Redis."""
    request = body(words(1000, "aw"), words(40, "aq"))
    fleet.redis.kill()
    wait_until(
        lambda: explain(fleet.gateways[0], request)["inputs"]["matched_blocks"] == "local",
        "matched blocks read locally",
    )
    inputs = explain(fleet.gateways[0], request)["inputs"]
    assert inputs["claim"] is None and inputs["prompt_share"] == "local"
    wait_until(
        lambda: explain(fleet.gateways[0], request)["inputs"]["load"] == "local",
        "the load read locally",
    )
    response = send(fleet.gateways[0], request)
    assert response.status_code == 200
    fleet.redis.start()
    wait_until(
        lambda: explain(fleet.gateways[0], request)["inputs"]["claim"] == "fleet",
        "the claim read from the fleet",
    )


def test_gateways_sharing_nothing_place_a_customer_prompt_alike(fleet: Fleet) -> None:
    """A new cold shared prompt is placed from its own key: two gateways that know nothing of
    each other's placements (no Redis) send it, under different questions, to one replica."""
    pair = (fleet.alone, fleet.apart)
    # The same other customers through both, one at a time, so that both count the same
    # recent traffic: the prompts below are cold (each one among many).
    for other in range(12):
        other_prompt = body(words(80, f"w{other}"), words(10, f"x{other}"))
        for gateway in pair:
            assert send(gateway, other_prompt).status_code == 200
    for customer in range(3):
        system = words(300, f"home{customer}")
        first, second = pair if customer % 2 == 0 else pair[::-1]
        placed = send(first, body(system, words(40, f"y{customer}")))
        followed = send(second, body(system, words(40, f"z{customer}")))
        assert placed.status_code == followed.status_code == 200
        # The second gateway has never seen the prompt: it placed it anew, by the same rule.
        assert placed.headers["x-gateway-route"] == "hash"
        assert followed.headers["x-gateway-route"] == "hash"
        assert followed.headers["x-gateway-backend"] == placed.headers["x-gateway-backend"]
