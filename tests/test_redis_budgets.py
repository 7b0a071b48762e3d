"""Tenants' budgets shared through a real redis-server: the script that charges and settles
them by Redis's clock, and the gate's side of it — a charge that falls back to the gateway's
share when Redis is away and goes back to the fleet's budgets when it answers again.

Budgets refill while a test runs, so every figure read back is bounded by the time elapsed.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterator

import pytest
from redis.crc import key_slot

from prefix_gateway.config.tenants import TenantSpec
from prefix_gateway.metrics import Metrics
from prefix_gateway.state.redis import KeySpace, RedisLink, open_client
from prefix_gateway.state.redis.budgets import BudgetAmount, RedisBudgets
from prefix_gateway.tenants.shared import SharedBudgets
from prefix_gateway.tenants.tenant import Tenant, TenantRefused
from tests.redis_server import RedisServer
from tests.support import eventually, metric_value

TIMEOUT = 0.5


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as started:
        yield started


def requests(amount: float, limit: int = 6) -> BudgetAmount:
    return BudgetAmount("requests", limit, amount)


def tokens(amount: float, limit: int = 600) -> BudgetAmount:
    return BudgetAmount("tokens", limit, amount)


def test_a_charge_takes_every_budget_or_none_and_settles_into_debt(server: RedisServer) -> None:
    keys = KeySpace("ns")
    began = time.monotonic()

    async def scenario() -> None:
        client = open_client(server.url, TIMEOUT, max_connections=2)
        store = RedisBudgets(client, keys)
        first = await store.take("team-a", [requests(1), tokens(500)])
        assert first.done and first.levels == (5.0, 100.0) and first.waits == (0.0, 0.0)
        refused = await store.take("team-a", [requests(1), tokens(300)])
        # 200 tokens short at 10 a second; the request budget alone would have fitted.
        assert not refused.done and refused.waits[0] == 0.0
        assert 0 < refused.waits[1] <= 20.0
        too_large = await store.take("team-a", [requests(1), tokens(601)])
        assert not too_large.done and math.isinf(too_large.waits[1])
        # Refusals took nothing; a settlement may take more than there is.
        settled = await store.give("team-a", [tokens(-1000)])
        elapsed = time.monotonic() - began
        assert settled.done
        assert -900.0 <= settled.levels[0] <= -900.0 + 10 * elapsed
        unchanged = await store.give("team-a", [requests(0)])
        assert 5.0 <= unchanged.levels[0] <= 5.0 + 0.1 * (time.monotonic() - began)
        indebted = await store.take("team-a", [tokens(1)])
        assert not indebted.done and indebted.waits[0] > 80.0
        await client.aclose()

    asyncio.run(scenario())
    requests_key, tokens_key = keys.budget("team-a", "requests"), keys.budget("team-a", "tokens")
    assert requests_key == "ns:t:{team-a}:requests"
    assert key_slot(requests_key.encode()) == key_slot(tokens_key.encode())
    # A key lives until its bucket is whole again, and a second: 11 s for the request budget,
    # one short of 6 a minute, less what refilled since (Redis counts in its own clock's
    # milliseconds: a second is left for it); two and a half minutes for the tokens in debt.
    refilled_ms = (time.monotonic() - began) * 1000
    assert 10_000 - refilled_ms < int(server.cli("pttl", requests_key)) <= 11_000
    assert int(server.cli("pttl", tokens_key)) > 120_000
    assert set(server.cli("hkeys", tokens_key).split()) == {"level", "at"}


def test_a_tenant_that_stops_leaves_nothing_in_redis(server: RedisServer) -> None:
    keys = KeySpace("ns")

    async def scenario() -> None:
        client = open_client(server.url, TIMEOUT, max_connections=2)
        store = RedisBudgets(client, keys)
        # 6000 a minute: the one request taken is back within 10 ms.
        assert (await store.take("brief", [requests(1, limit=6000)])).done
        assert int(server.cli("exists", keys.budget("brief", "requests"))) == 1
        await eventually(
            lambda: int(server.cli("exists", keys.budget("brief", "requests"))) == 0,
            "the whole bucket's key gone",
        )
        await client.aclose()

    asyncio.run(scenario())


def test_a_charge_falls_back_to_the_share_and_returns_to_the_fleet(server: RedisServer) -> None:
    spec = TenantSpec("team-b", "secret-key", requests_per_minute=6, tokens_per_minute=6000)
    metrics = Metrics()

    def count(name: str, **labels: str) -> float:
        return metric_value(metrics.render().decode(), name, **labels)

    async def scenario() -> None:
        client = open_client(server.url, TIMEOUT, max_connections=4)
        link = RedisLink(client, TIMEOUT, metrics, max_pending=8, backoff_max=0.2)
        keys = KeySpace("ns")
        shared = SharedBudgets(RedisBudgets(client, keys), link, lambda: 3, workers=1)
        tenant = Tenant(spec, time.monotonic(), fleet_wide=True)
        await link.start()
        held = await shared.take(tenant, 500)
        assert held.shared and held.reserved == 500
        assert tenant.tokens is not None and tenant.requests is not None
        assert tenant.requests.shared and tenant.requests.remaining(time.monotonic()) == 5
        # Settled in Redis, in the background: 400 of the 500 back.
        shared.give(tenant, 400, lambda settled: None)
        await eventually(lambda: link.pending == 0, "the settlement written")
        fleet = await RedisBudgets(client, keys).give("team-b", [tokens(0, limit=6000)])
        assert fleet.levels[0] >= 5900.0
        assert "secret-key" not in server.cli("--scan", "--pattern", "*")

        server.kill()
        # A third of 6 a minute is 2, of which the fleet had used a sixth when Redis went away:
        # one request fits.
        assert not (await shared.take(tenant, 10)).shared
        with pytest.raises(TenantRefused) as refusal:
            await shared.take(tenant, 10)
        assert refusal.value.reason == "requests_per_minute"
        assert tenant.requests.share == pytest.approx(1 / 3)
        assert not tenant.requests.shared
        assert count("gateway_redis_fallbacks_total", operation="budget_take") == 2
        assert count("gateway_redis_errors_total", operation="budget_take") == 1

        server.start()  # the same port, empty: the fleet's budgets are whole again
        await eventually(lambda: link.up, "the link up again")
        again = await shared.take(tenant, 10)
        assert again.shared and tenant.requests.shared
        assert tenant.requests.remaining(time.monotonic()) == 5
        await link.close()

    asyncio.run(scenario())
