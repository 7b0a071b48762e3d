"""`POST /admin/explain`: the decision a request would get, and why, without sending it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from prefix_gateway.backends.pool import BackendPool
from prefix_gateway.config import Settings
from prefix_gateway.emulator.replicas import EmulatedReplicas
from prefix_gateway.metrics import Metrics
from prefix_gateway.prompt.parsing import Endpoint, parse_request, session_hash
from prefix_gateway.routing.policies import build_policy
from prefix_gateway.routing.recorder import Stores
from prefix_gateway.routing.router import Router
from prefix_gateway.state.index import InMemoryPrefixIndex
from prefix_gateway.state.sessions import InMemorySessionStore
from tests.conftest import MODEL
from tests.support import PATIENCE_SECONDS, GatewayProcess, metric_value
from tests.words import words

TOKEN = "explain-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def admin(fleet: EmulatedReplicas) -> Iterator[GatewayProcess]:
    with GatewayProcess(fleet.urls, "--admin-token", TOKEN) as started:
        yield started


def explain(
    gateway: GatewayProcess, body: dict[str, Any], query: str = "", **headers: str
) -> httpx.Response:
    return httpx.post(
        f"{gateway.url}/admin/explain{query}",
        content=orjson.dumps(body),
        headers={**AUTH, **headers},
        timeout=5,
    )


def chat(gateway: GatewayProcess, body: dict[str, Any], **headers: str) -> httpx.Response:
    response = httpx.post(
        gateway.url + "/v1/chat/completions", json=body, headers=headers, timeout=10
    )
    assert response.status_code == 200, response.text
    return response


@pytest.mark.parametrize(
    ("headers", "status", "code"),
    [
        ({}, 401, "missing_token"),
        ({"authorization": "Basic abc"}, 401, "missing_token"),
        ({"authorization": "Bearer wrong"}, 403, "invalid_token"),
    ],
)
def test_the_admin_token_guards_explain(
    admin: GatewayProcess, headers: dict[str, str], status: int, code: str
) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    response = httpx.post(
        admin.url + "/admin/explain", json=body, headers=headers, timeout=PATIENCE_SECONDS
    )
    assert response.status_code == status
    error = response.json()["error"]
    assert error["code"] == code and set(error) == {"message", "type", "param", "code"}
    assert error["type"] == ("authentication_error" if status == 401 else "permission_error")


def test_explain_predicts_the_next_turn_without_recording_it(admin: GatewayProcess) -> None:
    messages = [
        {"role": "system", "content": words(400, "xs")},
        {"role": "user", "content": words(60, "xq0")},
    ]
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 40}
    first = chat(admin, body)
    answer = first.json()["choices"][0]["message"]["content"]
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "more?"}]
    before = admin.metrics()

    explained = explain(admin, body)
    assert explained.status_code == 200, explained.text
    decision = explained.json()
    assert decision["backend"] == first.headers["x-gateway-backend"]
    assert decision["route"] == "owner" and "clearly more" in decision["reason"]
    assert decision["matched_tokens"] >= 400
    assert decision["conversation"] == {
        "continuity": "extends",
        "previous_backend": first.headers["x-gateway-backend"],
        "cache_break": None,
    }
    assert decision["load_bound"] >= 2 and decision["policy"] == "prefix"
    assert len(decision["affinity_key"]) == 16
    candidates = {item["backend"]: item for item in decision["candidates"]}
    assert len(candidates) == 4
    chosen = candidates[decision["backend"]]
    assert chosen["matched_tokens"] == decision["matched_tokens"] and chosen["within_bound"]
    assert all(item["healthy"] and item["load"] == 0 for item in candidates.values())
    again = explain(admin, body).json()
    for item in again["candidates"] + decision["candidates"]:
        item.pop("recent_requests")  # decays with time
    assert again == decision  # nothing recorded: the same answer twice

    after = admin.metrics()
    for name in ("gateway_requests_total", "gateway_affinity_hits_total"):
        assert metric_value(after, name) == metric_value(before, name)
    assert metric_value(after, "gateway_index_blocks") == metric_value(
        before, "gateway_index_blocks"
    )

    second = chat(admin, body)  # the real request lands where explain said
    assert second.headers["x-gateway-backend"] == decision["backend"]


def test_an_unseen_prompt_stays_unseen_after_explain(admin: GatewayProcess) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": words(300, "xn")}]}
    assert explain(admin, body).json()["route"] == "hash"
    assert chat(admin, {**body, "max_tokens": 2}).headers["x-gateway-route"] == "hash"
    assert explain(admin, body).json()["route"] == "owner"


def test_a_prompt_under_another_cache_salt_is_not_predicted_cached(admin: GatewayProcess) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": words(300, "salted")}],
        "max_tokens": 2,
        "cache_salt": "salt-one",
    }
    salted = chat(admin, body)
    backend = salted.headers["x-gateway-backend"]

    def matched(salt: str | None) -> int:
        asked = (
            {**body, "cache_salt": salt}
            if salt
            else {k: v for k, v in body.items() if k != "cache_salt"}
        )
        rows = explain(admin, asked).json()["candidates"]
        return sum(row["matched_tokens"] for row in rows)

    assert matched("salt-one") >= 256
    # The replica keeps the salt's blocks apart: neither another salt nor none reuses them.
    assert matched("salt-two") == matched(None) == 0
    again = chat(admin, {**body, "cache_salt": "salt-two"})
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    repeat = chat(admin, body)
    assert repeat.headers["x-gateway-backend"] == backend
    assert repeat.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256


def test_explain_shows_the_session_and_a_cache_break(admin: GatewayProcess) -> None:
    system = {"role": "system", "content": words(100, "xy")}
    turns = [{"role": "user", "content": words(30, f"xt{turn}")} for turn in range(3)]
    first = chat(
        admin,
        {"model": MODEL, "messages": [system, *turns], "max_tokens": 2},
        **{"x-session-id": "explain-1"},
    )
    trimmed = {"model": MODEL, "messages": [system, *turns[1:]]}
    decision = explain(admin, trimmed, **{"x-session-id": "explain-1"}).json()
    assert decision["route"] == "session"
    assert decision["sticky_backend"] == first.headers["x-gateway-backend"]
    assert decision["session_key"] == session_hash("explain-1")  # only its hash is kept
    assert decision["conversation"]["continuity"] == "break"
    assert decision["conversation"]["cache_break"] == "front_trim"


def test_the_endpoint_is_given_or_inferred(admin: GatewayProcess) -> None:
    completion = {"model": MODEL, "prompt": words(100, "xc")}
    assert explain(admin, completion).json()["endpoint"] == "/v1/completions"
    embedding = {"model": MODEL, "input": "one"}
    assert explain(admin, embedding).json()["endpoint"] == "/v1/embeddings"
    response = {"model": MODEL, "input": "one", "instructions": "be brief"}
    assert explain(admin, response).json()["endpoint"] == "/v1/responses"
    tokenize = explain(admin, {"model": MODEL, "prompt": "x"}, "?endpoint=/tokenize").json()
    assert (tokenize["endpoint"], tokenize["route"]) == ("/tokenize", "least_loaded")
    given = explain(admin, completion, "?endpoint=/v1/completions").json()
    assert given["endpoint"] == "/v1/completions"


@pytest.mark.parametrize(
    ("body", "query", "status", "code"),
    [
        ({"model": MODEL}, "", 400, "invalid_endpoint"),
        ({"model": MODEL, "prompt": "x"}, "?endpoint=/v1/nothing", 400, "invalid_endpoint"),
        ({"model": MODEL, "messages": "x"}, "", 400, "invalid_messages"),
        ({"model": "no-such-model", "prompt": "x"}, "", 404, "model_not_found"),
    ],
)
def test_bad_explain_requests_are_openai_errors(
    admin: GatewayProcess, body: dict[str, Any], query: str, status: int, code: str
) -> None:
    response = explain(admin, body, query)
    assert response.status_code == status
    assert response.json()["error"]["code"] == code


def test_explain_leaves_a_round_robin_turn_where_it_was() -> None:
    settings = Settings(policy="round_robin", backend=("m=http://a:1", "m=http://b:1"))
    pool = BackendPool.from_specs(settings.backend)
    for backend in pool.backends:
        pool.set_health(backend, True)
    index = InMemoryPrefixIndex(600, 1000)
    router = Router(
        settings,
        pool,
        Stores(index, InMemorySessionStore(600, 1000)),
        build_policy(settings),
        Metrics(),
    )
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": words(200)}]})
    request = parse_request(Endpoint.CHAT, body, None)

    async def scenario() -> list[str]:
        explained = [(await router.explain(request)).placement.backend.name for _ in range(3)]
        assert len(index) == 0 and len(router.memory.conversations) == 0
        assert router.memory.traffic.recent.snapshot(["a:1", "b:1"]) == {}
        routed = await router.route(request)
        after = await router.explain(request)
        return [*explained, routed.backend.name, after.placement.backend.name]

    assert asyncio.run(scenario()) == ["a:1", "a:1", "a:1", "a:1", "b:1"]


def test_explain_sends_a_follow_up_to_the_replica_holding_its_response(
    admin: GatewayProcess,
) -> None:
    body = {"model": MODEL, "input": words(50, "xr"), "max_output_tokens": 2}
    created = httpx.post(admin.url + "/v1/responses", json=body, timeout=10)
    assert created.status_code == 200
    follow_up = {"model": MODEL, "input": "more", "previous_response_id": created.json()["id"]}
    explained = explain(admin, follow_up).json()
    assert explained["endpoint"] == "/v1/responses"
    assert explained["route"] == "previous_response"
    assert explained["backend"] == created.headers["x-gateway-backend"]
    unknown = explain(admin, {**follow_up, "previous_response_id": "resp_unknown"})
    assert unknown.status_code == 404
