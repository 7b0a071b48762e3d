"""Tenants' budgets across a fleet: three gateway processes with one `tenants:` file share one
redis-server in front of emulated replicas, and requests go to them in rotation, as a
Kubernetes Service would spread them. The official client sees the fleet's limit and the
fleet's remaining count; with Redis killed each gateway enforces its share and answers every
request; with Redis back the budgets are the fleet's again. Each test has tenants of its own;
the one that kills Redis starts it again, and waits for every gateway to be back on it.

A budget of 6 requests a minute gets one back every 10 s, so counts are bounded by the time a
burst took, never by assuming it was quick.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
import yaml

from prefix_gateway.emulator.replicas import EmulatedReplicas
from tests.redis_server import PATIENT, RedisServer
from tests.support import GatewayProcess, gateways_on_redis, wait_until

pytestmark = pytest.mark.fleet

MODEL = "emulated-model"
GATEWAYS = 3
TENANTS: list[dict[str, Any]] = [
    {"name": "rpm", "api_key": "rpm-key", "requests_per_minute": 6},
    {"name": "tpm", "api_key": "tpm-key", "tokens_per_minute": 600},
    {"name": "outage", "api_key": "outage-key", "requests_per_minute": 6},
    {"name": "used", "api_key": "used-key", "requests_per_minute": 6},
    {"name": "resumed", "api_key": "resumed-key", "requests_per_minute": 6},
]


@dataclass
class Fleet:
    redis: RedisServer
    gateways: list[GatewayProcess]

    def total(self, name: str, **labels: str) -> float:
        return sum(gateway.metric(name, **labels) for gateway in self.gateways)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    config = tmp_path_factory.mktemp("tenants") / "gateway.yaml"
    config.write_text(yaml.safe_dump({"tenants": TENANTS}))
    with EmulatedReplicas(2, MODEL) as replicas, RedisServer() as redis:
        args = ("--config", str(config), *PATIENT)
        with gateways_on_redis(GATEWAYS, replicas.urls, redis.url, *args) as started:
            yield Fleet(redis, started)


@dataclass
class Burst:
    """Requests of one tenant sent one after another to the gateways in rotation."""

    served: list[int] = field(default_factory=list)
    """The positions of the requests answered 200."""
    headers: list[Mapping[str, str]] = field(default_factory=list)
    usage: list[float] = field(default_factory=list)
    """What each request served cost its budget (cached prompt tokens at 0.1)."""
    refusals: list[openai.RateLimitError] = field(default_factory=list)
    seconds: float = 0.0

    def refilled(self, per_minute: float) -> int:
        """The most a budget of `per_minute` can have got back while the burst ran."""
        return math.floor(self.seconds * per_minute / 60)


def burst(gateways: list[GatewayProcess], key: str, count: int, max_tokens: int = 4) -> Burst:
    clients = [
        openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)
        for gateway in gateways
    ]
    result = Burst()
    began = time.monotonic()
    for position in range(count):
        api = clients[position % len(clients)]
        try:
            raw = api.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"request {position} for {key}"}],
                max_tokens=max_tokens,
            )
        except openai.RateLimitError as refusal:
            assert refusal.code == "rate_limit_exceeded"
            result.refusals.append(refusal)
            continue
        usage = raw.parse().usage
        assert usage is not None
        details = usage.prompt_tokens_details
        cached = (details.cached_tokens or 0) if details is not None else 0
        result.usage.append(usage.prompt_tokens - 0.9 * cached + usage.completion_tokens)
        result.served.append(position)
        result.headers.append(raw.headers)
    result.seconds = time.monotonic() - began
    for api in clients:
        api.close()
    return result


def budget_view(gateway: GatewayProcess, tenant: str, kind: str = "requests") -> dict[str, Any]:
    views = httpx.get(gateway.url + "/admin/tenants", timeout=10).json()["data"]
    (view,) = [view for view in views if view["name"] == tenant]
    budget: dict[str, Any] = view["budgets"][kind]
    return budget


def test_a_limit_per_minute_is_the_fleets_and_so_is_what_remains(fleet: Fleet) -> None:
    refused_before = fleet.total("gateway_tenant_refusals_total", tenant="rpm")
    served_before = fleet.total("gateway_tenant_requests_total", tenant="rpm", status="200")
    sent = burst(fleet.gateways, "rpm-key", 9)
    extra = sent.refilled(6)
    # Exactly the limit within the minute, however the requests were spread: the first six,
    # two at each gateway; then refusals (or one more per 10 s the burst took).
    assert 6 <= len(sent.served) <= 6 + extra
    assert sent.served[:6] == list(range(6))
    remaining = [int(headers["x-ratelimit-remaining-requests"]) for headers in sent.headers]
    # Each answer shows what the fleet has left, whichever gateway gave it.
    assert remaining[0] == 5
    assert all(left <= 5 - turn + extra for turn, left in enumerate(remaining))
    assert remaining == sorted(remaining, reverse=True) or extra
    assert {headers["x-ratelimit-limit-requests"] for headers in sent.headers} == {"6"}
    for refusal in sent.refusals:
        assert "requests per minute" in refusal.message and "rpm" in refusal.message
        assert int(refusal.response.headers["retry-after"]) >= 1
        assert refusal.response.headers["x-ratelimit-remaining-requests"] == "0"
    refused = fleet.total("gateway_tenant_refusals_total", tenant="rpm") - refused_before
    assert refused == len(sent.refusals) >= 9 - 6 - extra
    served = fleet.total("gateway_tenant_requests_total", tenant="rpm", status="200")
    assert served - served_before == len(sent.served)
    assert all(budget_view(gateway, "rpm")["shared"] for gateway in fleet.gateways)


def test_tokens_per_minute_are_the_fleets(fleet: Fleet) -> None:
    began = time.monotonic()
    # More than the fleet's whole minute: too large, whichever gateway is asked; a third of
    # the limit and more is not.
    too_large = burst(fleet.gateways[:1], "tpm-key", 1, max_tokens=700)
    (refusal,) = too_large.refusals
    assert "request too large" in refusal.message
    assert "retry-after" not in refusal.response.headers
    large = burst(fleet.gateways[1:2], "tpm-key", 1, max_tokens=300)
    assert large.served == [0]
    # About 100 tokens a request (a short prompt and 90 generated): three more fit.
    sent = burst(fleet.gateways, "tpm-key", 12, max_tokens=90)
    refilled = math.floor((time.monotonic() - began) * 10)  # 600 a minute
    largest = max(sent.usage)
    used = large.usage[0] + sum(sent.usage)
    # What the fleet served is the limit, give or take one request (each is charged its
    # estimate and settled a moment later) and the refill while the requests ran.
    assert 600 - 2 * largest <= used <= 600 + refilled + largest
    assert len(sent.refusals) == 12 - len(sent.served) > 0
    remaining = [int(headers["x-ratelimit-remaining-tokens"]) for headers in sent.headers]
    for turn, left in enumerate(remaining):
        assert left <= 600 + refilled + largest - large.usage[0] - sum(sent.usage[:turn])
    for refusal in sent.refusals:
        assert "tokens per minute" in refusal.message
        assert int(refusal.response.headers["retry-after"]) >= 1
    served_at = {position % GATEWAYS for position in sent.served}
    assert len(served_at) > 1  # gateways charged the one budget


def test_with_redis_killed_each_gateway_enforces_its_share_and_with_it_back_the_fleet_does(
    fleet: Fleet,
) -> None:
    gateways = fleet.gateways
    # A tenant that has used its minute, with Redis up.
    assert len(burst(gateways, "used-key", 6).served) == 6
    before = [
        gateway.metric("gateway_redis_fallbacks_total", operation="budget_take")
        for gateway in gateways
    ]
    errors_before = fleet.total("gateway_redis_errors_total")
    fleet.redis.kill()  # SIGKILL: every budget it held is lost
    try:
        sent = [burst([gateway], "outage-key", 4) for gateway in gateways]
        # A third of 6 a minute each (the gateways last seen), one more per 30 s a burst took.
        for alone in sent:
            assert 2 <= len(alone.served) <= 2 + alone.refilled(2)
            assert alone.served[:2] == [0, 1]
            for refusal in alone.refusals:
                assert "requests per minute" in refusal.message
        # A tenant whose minute the fleet had used goes on from where it stood; either way
        # every request is answered with a 200 or a 429 that says why (never a 5xx).
        for gateway in gateways:
            burst([gateway], "used-key", 1)
        for gateway, counted in zip(gateways, before, strict=True):
            after = gateway.metric("gateway_redis_fallbacks_total", operation="budget_take")
            assert after - counted == 5
            view = budget_view(gateway, "outage")
            assert not view["shared"] and view["share"] == round(1 / 3, 4)
        assert fleet.total("gateway_redis_errors_total") > errors_before
    finally:
        fleet.redis.start()  # the same port, empty
        wait_until(lambda: fleet.total("gateway_redis_up") == GATEWAYS, "every gateway on Redis")
    sent_again = burst(gateways, "resumed-key", 9)
    extra = sent_again.refilled(6)
    assert 6 <= len(sent_again.served) <= 6 + extra
    remaining = [int(headers["x-ratelimit-remaining-requests"]) for headers in sent_again.headers]
    assert remaining[0] == 5
    assert all(left <= 5 - turn + extra for turn, left in enumerate(remaining))
    assert all(budget_view(gateway, "resumed")["shared"] for gateway in gateways)
    # Redis holds the budgets under the tenants' names, never their keys.
    stored = fleet.redis.cli("--scan", "--pattern", "pgw:t:*").split()
    assert "pgw:t:{resumed}:requests" in stored
    assert not any("key" in name for name in stored)
