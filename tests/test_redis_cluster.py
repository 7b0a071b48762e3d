"""Redis Cluster: three masters the test joins itself, named by a `redis+cluster://` URL.

The contract suite in test_index.py also runs on such a cluster; here, prompts must spread
over every node (one lookup, one slot — many prompts, many slots), and two gateway processes
must share what they learn through it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from prefix_gateway.clock import ManualClock
from prefix_gateway.emulator.replicas import EmulatedReplicas
from prefix_gateway.state.redis import (
    BudgetAmount,
    KeySpace,
    RedisAgreement,
    RedisBudgets,
    RedisPrefixIndex,
    RedisSessionStore,
    RedisSlots,
    open_client,
)
from tests.conftest import MODEL
from tests.redis_server import PATIENT, RedisClusterServers
from tests.support import GatewayProcess
from tests.words import words

pytestmark = pytest.mark.fleet


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterServers]:
    with RedisClusterServers() as started:
        yield started


def test_prompts_spread_over_every_node_and_each_lookup_stays_on_one(
    cluster: RedisClusterServers,
) -> None:
    chains = [[(prompt << 52) + block for block in range(1, 41)] for prompt in range(1, 61)]

    async def scenario() -> None:
        client = open_client(cluster.url, timeout=1.0, max_connections=8)
        keys = KeySpace("spread")
        index = RedisPrefixIndex(client, keys, 600)
        sessions = RedisSessionStore(client, keys, 600)
        for position, chain in enumerate(chains):
            await index.record(MODEL, f"b:{position % 4}", chain)
            await sessions.put(f"s{position}", f"b:{position % 4}")
        for position, chain in enumerate(chains):
            assert await index.match(MODEL, chain) == {f"b:{position % 4}": 40}
            assert await sessions.get(f"s{position}") == f"b:{position % 4}"
        await index.forget(MODEL, "b:0", chains[0][10:])
        assert await index.match(MODEL, chains[0]) == {"b:0": 10}
        await client.aclose()

    asyncio.run(scenario())
    # This test's keys only: the module's other tests write theirs to the same cluster.
    count = "return #redis.call('keys', ARGV[1])"  # the keys are bytes: counted in the server
    per_node = [int(node.cli("eval", count, "0", "spread:*")) for node in cluster.nodes]
    assert sum(per_node) == 60 * 40 - 30 + 60
    assert all(keys > 300 for keys in per_node), per_node


def test_claims_and_prompt_counts_live_in_their_prompts_slots(
    cluster: RedisClusterServers,
) -> None:
    clock = ManualClock(1_000_000.0)

    async def scenario() -> None:
        client = open_client(cluster.url, timeout=1.0, max_connections=8)
        agreement = RedisAgreement(client, KeySpace("agree"), 10.0, 30.0, clock)
        # 60 prompts over the 16,384 slots: each script touches two keys of one slot.
        for prompt in range(1, 61):
            first, shared = prompt << 52, (prompt << 52) + 7
            seen = await agreement.consult(MODEL, first, shared, shared, count=True)
            assert seen.claimed is None and seen.prompt_count == 1.0
            await agreement.claim(MODEL, first, shared, f"b:{prompt % 4}")
            await agreement.claim(MODEL, first, shared, "late:1")  # the first writer won
            clock.advance(30.0)
            again = await agreement.consult(MODEL, first, shared, shared, count=False)
            assert again.claimed == f"b:{prompt % 4}"
            assert again.prompt_count == pytest.approx(0.5)
        await client.aclose()

    asyncio.run(scenario())
    assert all(int(node.cli("dbsize")) > 0 for node in cluster.nodes)


def test_a_tenants_budgets_are_charged_in_one_slot(cluster: RedisClusterServers) -> None:
    async def scenario() -> None:
        client = open_client(cluster.url, timeout=1.0, max_connections=8)
        budgets = RedisBudgets(client, KeySpace("budgets"))
        # Both budgets of a tenant in one script: its name's slot holds them (no CROSSSLOT).
        for tenant in range(30):
            amounts = [BudgetAmount("requests", 6, 1), BudgetAmount("tokens", 600, 100)]
            taken = await budgets.take(f"team-{tenant}", amounts)
            assert taken.done and taken.levels == (5.0, 500.0)
        await client.aclose()

    asyncio.run(scenario())
    per_node = [
        len(node.cli("--scan", "--pattern", "budgets:t:*").split()) for node in cluster.nodes
    ]
    assert sum(per_node) == 60 and all(per_node), per_node


def test_a_tenants_requests_in_flight_are_counted_in_its_slot(
    cluster: RedisClusterServers,
) -> None:
    async def scenario() -> None:
        client = open_client(cluster.url, timeout=1.0, max_connections=8)
        keys = KeySpace("slots")
        first, second = (RedisSlots(client, keys, name, ttl=60) for name in ("one", "two"))
        for tenant in range(30):
            name = f"team-{tenant}"
            assert (await first.enter(name, 1, order=1, limit=2)).done
            assert (await second.enter(name, 1, order=1, limit=2)).done
            # Full: a second request at either process does not fit, and is not counted.
            refused = await second.enter(name, 2, order=2, limit=2)
            assert not refused.done and refused.fleet_in_flight == 2
            # A count older than the one stored is not written; a newer one is.
            await first.write(name, 0, order=0)
            assert not (await second.enter(name, 2, order=3, limit=2)).done
            await first.write(name, 0, order=4)
            admitted = await second.enter(name, 2, order=5, limit=2)
            assert admitted.done and admitted.fleet_in_flight == 2
        await client.aclose()

    asyncio.run(scenario())
    per_node = [
        len(node.cli("--scan", "--pattern", "slots:t:*").split()) for node in cluster.nodes
    ]
    assert sum(per_node) == 30 and all(per_node), per_node


def test_gateways_share_a_conversation_through_the_cluster(cluster: RedisClusterServers) -> None:
    with EmulatedReplicas(2, MODEL, ["--chat-template", "plain"]) as fleet:
        gateways = [
            GatewayProcess(
                fleet.urls, "--redis-url", cluster.url, *PATIENT, "--redis-prefix", "e2e"
            )
            for _ in range(2)
        ]
        try:
            for gateway in gateways:
                gateway.start()
            messages = [{"role": "system", "content": words(500, "cl-s")}]
            served: list[str] = []
            routes: list[str] = []
            for turn in range(4):
                messages.append({"role": "user", "content": words(50, f"cl-q{turn}")})
                response = httpx.post(
                    gateways[turn % 2].url + "/v1/chat/completions",
                    json={"model": MODEL, "messages": messages, "max_tokens": 50},
                    timeout=30,
                )
                assert response.status_code == 200
                served.append(response.headers["x-gateway-backend"])
                routes.append(response.headers["x-gateway-route"])
                content = response.json()["choices"][0]["message"]["content"]
                messages.append({"role": "assistant", "content": content})
            assert served == [served[0]] * 4
            assert routes[1:] == ["owner"] * 3
            assert all(gateway.metric("gateway_redis_up") == 1 for gateway in gateways)
            assert sum(gateway.metric("gateway_redis_errors_total") for gateway in gateways) == 0
        finally:
            for gateway in gateways:
                gateway.stop()
