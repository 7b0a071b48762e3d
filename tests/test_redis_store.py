"""The Redis-backed stores against a real redis-server: sharing, deadlines, outages, memory.

Slowness is a real server paused with CLIENT PAUSE, an outage a killed server, a restart the same
port answering again with nothing in it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import pytest
from redis.crc import key_slot

from gateway.index import InMemoryPrefixIndex
from gateway.metrics import Metrics
from gateway.redis_store import (
    FallbackPrefixIndex,
    FallbackSessionStore,
    KeySpace,
    RedisLink,
    RedisPrefixIndex,
    RedisSessionStore,
    open_client,
)
from gateway.redis_store.keys import HASH_BYTES
from gateway.sessions import InMemorySessionStore
from tests.redis_server import RedisServer
from tests.support import free_port, metric_value

TIMEOUT = 0.05
MODEL = "m"
CHAIN = list(range(1001, 1041))  # 40 blocks


class Gateway:
    """What one gateway process holds: a link, and local stores wrapped by Redis-backed ones."""

    def __init__(self, url: str, namespace: str, max_pending: int = 16) -> None:
        self.metrics = Metrics()
        client = open_client(url, TIMEOUT, max_connections=8)
        self.link = RedisLink(client, TIMEOUT, self.metrics, max_pending, backoff_max=0.2)
        keys = KeySpace(namespace)
        self.index = FallbackPrefixIndex(
            InMemoryPrefixIndex(600, 100_000),
            RedisPrefixIndex(client, keys, 600),
            self.link,
            ttl=600,
        )
        self.sessions = FallbackSessionStore(
            InMemorySessionStore(600, 1000), RedisSessionStore(client, keys, 600), self.link
        )

    def count(self, name: str, **labels: str) -> float:
        return metric_value(self.metrics.render().decode(), name, **labels)

    async def settle(self) -> None:
        """Wait for the background writes in flight."""
        while self.link.pending:
            await asyncio.sleep(0.005)


async def eventually(condition: Callable[[], bool], seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as started:
        yield started


def test_what_one_gateway_learns_another_one_matches(server: RedisServer) -> None:
    async def scenario() -> None:
        first, second = Gateway(server.url, "ns"), Gateway(server.url, "ns")
        await first.link.start()
        await second.link.start()
        await first.index.record(MODEL, "10.0.0.1:8000", CHAIN)
        await first.sessions.put("conversation-1", "10.0.0.2:8000")
        await first.settle()
        assert await second.index.match(MODEL, [*CHAIN, 7]) == {"10.0.0.1:8000": 40}
        assert await second.sessions.get("conversation-1") == "10.0.0.2:8000"
        assert second.count("gateway_redis_fallbacks_total") == 0
        assert second.count("gateway_redis_operation_seconds_count", operation="match") == 1
        other = Gateway(server.url, "other-namespace")
        await other.link.start()
        assert await other.index.match(MODEL, CHAIN) == {}
        for gateway in (first, second, other):
            await gateway.link.close()

    asyncio.run(scenario())


def test_what_another_gateway_forgot_stays_forgotten(server: RedisServer) -> None:
    async def scenario() -> None:
        first, second = Gateway(server.url, "ns"), Gateway(server.url, "ns")
        await first.link.start()
        await second.link.start()
        await first.index.record(MODEL, "a:1", CHAIN)
        await first.settle()
        assert await second.index.match(MODEL, CHAIN) == {"a:1": 40}
        await second.index.forget(MODEL, "a:1", CHAIN[10:])  # a:1 reported a shorter hit
        await second.settle()
        # The first gateway's own memory still says 40; Redis has lost none of its writes, so
        # Redis's answer stands.
        assert await first.index.local.match(MODEL, CHAIN) == {"a:1": 40}
        assert await first.index.match(MODEL, CHAIN) == {"a:1": 10}
        for gateway in (first, second):
            await gateway.link.close()

    asyncio.run(scenario())


def test_a_slow_redis_costs_one_timeout_then_nothing_until_it_answers(server: RedisServer) -> None:
    async def scenario() -> None:
        gateway = Gateway(server.url, "ns")
        await gateway.link.start()
        await gateway.index.record(MODEL, "a:1", CHAIN)
        await gateway.settle()
        server.cli("client", "pause", "1500", "all")
        paused_at = time.monotonic()
        began = time.perf_counter()
        # The local index answers once the deadline passes.
        assert await gateway.index.match(MODEL, CHAIN) == {"a:1": 40}
        assert time.perf_counter() - began < 0.5
        assert not gateway.link.up
        began = time.perf_counter()
        assert await gateway.sessions.get("nobody") is None
        assert time.perf_counter() - began < 0.01  # known to be away: not asked at all
        assert gateway.count("gateway_redis_errors_total", operation="match") == 1
        assert gateway.count("gateway_redis_fallbacks_total", operation="match") == 1
        assert gateway.count("gateway_redis_fallbacks_total", operation="session_get") == 1
        assert gateway.count("gateway_redis_up") == 0
        await eventually(lambda: gateway.link.up)
        assert time.monotonic() - paused_at > 1.0
        assert gateway.count("gateway_redis_up") == 1
        await gateway.link.close()

    asyncio.run(scenario())


def test_a_restarted_empty_redis_is_backed_by_the_local_index(server: RedisServer) -> None:
    async def scenario() -> None:
        gateway = Gateway(server.url, "ns")
        await gateway.link.start()
        await gateway.index.record(MODEL, "a:1", CHAIN)
        await gateway.settle()
        server.kill()
        assert await gateway.index.match(MODEL, CHAIN) == {"a:1": 40}
        assert not gateway.link.up
        await gateway.index.record(MODEL, "b:2", CHAIN[:10])  # local only while it is away
        server.start()
        await eventually(lambda: gateway.link.up)
        # Redis lost everything; what this gateway learned still routes.
        assert await gateway.index.match(MODEL, CHAIN) == {"a:1": 40, "b:2": 10}
        await gateway.index.record(MODEL, "c:3", CHAIN)
        await gateway.settle()
        fresh = Gateway(server.url, "ns")
        await fresh.link.start()
        assert await fresh.index.match(MODEL, CHAIN) == {"c:3": 40}
        assert gateway.count("gateway_redis_fallbacks_total", operation="record") == 1
        await gateway.link.close()
        await fresh.link.close()

    asyncio.run(scenario())


def test_a_gateway_started_while_redis_is_away_serves_and_connects_later() -> None:
    port = free_port()

    async def scenario() -> None:
        gateway = Gateway(f"redis://127.0.0.1:{port}/0", "ns")
        began = time.perf_counter()
        await gateway.link.start()
        assert time.perf_counter() - began < 0.5
        assert not gateway.link.up
        await gateway.index.record(MODEL, "a:1", CHAIN)
        assert await gateway.index.match(MODEL, CHAIN) == {"a:1": 40}
        with RedisServer(port=port):
            await eventually(lambda: gateway.link.up)
            await gateway.index.record(MODEL, "a:1", CHAIN)
            await gateway.settle()
            assert await gateway.index.shared.match(MODEL, CHAIN) == {"a:1": 40}
            await gateway.link.close()

    asyncio.run(scenario())


def test_background_writes_in_flight_are_bounded(server: RedisServer) -> None:
    async def scenario() -> None:
        gateway = Gateway(server.url, "ns", max_pending=2)
        await gateway.link.start()
        for backend in ("a:1", "b:2", "c:3", "d:4", "e:5"):
            await gateway.index.record(MODEL, backend, CHAIN)
        assert gateway.link.pending == 2
        assert gateway.count("gateway_redis_fallbacks_total", operation="record") == 3
        await gateway.settle()
        assert await gateway.index.shared.match(MODEL, CHAIN) == {"a:1": 40, "b:2": 40}
        await gateway.link.close()

    asyncio.run(scenario())


def test_at_maxmemory_the_least_recently_written_blocks_go_first() -> None:
    # Every write restarts a block key's TTL, so volatile-ttl evicts what was written longest ago.
    with RedisServer("--maxmemory", "2mb", "--maxmemory-policy", "volatile-ttl") as server:

        async def scenario() -> None:
            gateway = Gateway(server.url, "ns")
            await gateway.link.start()
            chains = [
                [prompt * 1000 + block for block in range(1, 101)] for prompt in range(1, 300)
            ]
            for chain in chains:
                await gateway.index.shared.record(MODEL, "a:1", chain)
            info = await gateway.link.client.info()
            assert info["evicted_keys"] > 0
            depths = [(await gateway.index.match(MODEL, chain)).get("a:1", 0) for chain in chains]
            assert sum(depths[:50]) < sum(depths[-50:]) / 4
            assert depths[-1] == 100
            assert gateway.count("gateway_redis_errors_total") == 0
            await gateway.link.close()

        asyncio.run(scenario())


def test_an_error_reply_fails_one_operation_and_keeps_the_link_up() -> None:
    with RedisServer("--maxmemory-policy", "noeviction") as server:

        async def scenario() -> None:
            gateway = Gateway(server.url, "ns")
            await gateway.link.start()
            await gateway.index.record(MODEL, "a:1", CHAIN)
            await gateway.settle()
            server.cli("config", "set", "maxmemory", "1")  # full: every write is refused
            await gateway.index.record(MODEL, "b:2", list(range(5001, 5100)))
            await gateway.settle()
            assert gateway.count("gateway_redis_errors_total", operation="record") == 1
            assert gateway.link.up
            assert await gateway.index.match(MODEL, CHAIN) == {"a:1": 40}
            await gateway.link.close()

        asyncio.run(scenario())


def test_one_lookup_is_one_slot_and_prompts_spread_over_slots() -> None:
    keys = KeySpace("pgw")
    slots = set()
    for prompt in range(200):
        chain = [(prompt << 56) + block for block in range(1, 30)]
        prefix = keys.block_prefix(MODEL, chain[0])
        names = keys.block_keys(prefix, chain)
        width = len(prefix) + HASH_BYTES
        chain_slots = {
            key_slot(names[start : start + width]) for start in range(0, len(names), width)
        }
        assert len(chain_slots) == 1
        slots |= chain_slots
    assert len(slots) > 150
    assert keys.session("a").startswith("pgw:s:")
    with pytest.raises(ValueError):
        KeySpace("bad{prefix}")
