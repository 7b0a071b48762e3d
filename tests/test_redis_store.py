"""The Redis-backed stores against a real redis-server: sharing, deadlines, outages, memory.

Slowness is a real server paused with CLIENT PAUSE, an outage a killed server, a restart the same
port answering again with nothing in it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest
from redis.crc import key_slot

from prefix_gateway.backends.backend import Backend
from prefix_gateway.backends.engine_load import EngineLoadScraper
from prefix_gateway.backends.pool import BackendPool
from prefix_gateway.backends.shared_load import SharedLoad
from prefix_gateway.clock import ManualClock
from prefix_gateway.metrics import Metrics
from prefix_gateway.state.index import InMemoryPrefixIndex
from prefix_gateway.state.redis import (
    FallbackPrefixIndex,
    FallbackSessionStore,
    KeySpace,
    RedisLink,
    RedisPrefixIndex,
    RedisSessionStore,
    open_client,
)
from prefix_gateway.state.redis.index import pack_hashes
from prefix_gateway.state.redis.keys import HASH_BYTES
from prefix_gateway.state.sessions import InMemorySessionStore
from tests.redis_server import RedisServer
from tests.support import PATIENCE_SECONDS, eventually, free_port, metric_value

# Redis's deadline: far above a loopback round trip on a busy machine, far below the pause.
TIMEOUT = 0.5
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

    async def learn(self, model: str, backend: str, chain: list[int]) -> None:
        """What routing does once a replica accepted a prompt: record it here, share it."""
        await self.index.record(model, backend, chain)
        self.index.share(model, backend, chain)

    async def settle(self) -> None:
        """Wait for the background writes in flight."""
        while self.link.pending:
            await asyncio.sleep(0.005)


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as started:
        yield started


def test_what_one_gateway_learns_another_one_matches(server: RedisServer) -> None:
    async def scenario() -> None:
        first, second = Gateway(server.url, "ns"), Gateway(server.url, "ns")
        await first.link.start()
        await second.link.start()
        await first.learn(MODEL, "10.0.0.1:8000", CHAIN)
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
        await first.learn(MODEL, "a:1", CHAIN)
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
        await gateway.learn(MODEL, "a:1", CHAIN)
        await gateway.settle()
        server.cli("client", "pause", "3000", "all")
        paused_at = time.monotonic()
        # The local index answers once the deadline passes.
        assert await gateway.index.match(MODEL, CHAIN) == {"a:1": 40}
        assert not gateway.link.up
        assert await gateway.sessions.get("nobody") is None
        # Known to be away: not asked at all, so no second timeout was waited out.
        assert gateway.count("gateway_redis_errors_total") == 1
        assert gateway.count("gateway_redis_operation_seconds_count", operation="session_get") == 0
        assert gateway.count("gateway_redis_errors_total", operation="match") == 1
        assert gateway.count("gateway_redis_fallbacks_total", operation="match") == 1
        assert gateway.count("gateway_redis_fallbacks_total", operation="session_get") == 1
        assert gateway.count("gateway_redis_up") == 0
        await eventually(lambda: gateway.link.up, "the link up again")
        assert time.monotonic() - paused_at > 2.5  # not before Redis answered again
        assert gateway.count("gateway_redis_up") == 1
        await gateway.link.close()

    asyncio.run(scenario())


def test_a_restarted_empty_redis_is_backed_by_the_local_index(server: RedisServer) -> None:
    async def scenario() -> None:
        gateway = Gateway(server.url, "ns")
        await gateway.link.start()
        await gateway.learn(MODEL, "a:1", CHAIN)
        await gateway.settle()
        server.kill()
        assert await gateway.index.match(MODEL, CHAIN) == {"a:1": 40}
        assert not gateway.link.up
        await gateway.learn(MODEL, "b:2", CHAIN[:10])  # local only while it is away
        server.start()
        await eventually(lambda: gateway.link.up, "the link up again")
        # Redis lost everything; what this gateway learned still routes.
        assert await gateway.index.match(MODEL, CHAIN) == {"a:1": 40, "b:2": 10}
        await gateway.learn(MODEL, "c:3", CHAIN)
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
        await gateway.link.start()  # refused: it serves from local state at once
        assert not gateway.link.up
        await gateway.learn(MODEL, "a:1", CHAIN)
        assert await gateway.index.match(MODEL, CHAIN) == {"a:1": 40}
        with RedisServer(port=port):
            await eventually(lambda: gateway.link.up, "the link up again")
            await gateway.learn(MODEL, "a:1", CHAIN)
            await gateway.settle()
            assert await gateway.index.shared.match(MODEL, CHAIN) == {"a:1": 40}
            await gateway.link.close()

    asyncio.run(scenario())


def test_background_writes_in_flight_are_bounded(server: RedisServer) -> None:
    async def scenario() -> None:
        gateway = Gateway(server.url, "ns", max_pending=2)
        await gateway.link.start()
        for backend in ("a:1", "b:2", "c:3", "d:4", "e:5"):
            await gateway.learn(MODEL, backend, CHAIN)
        assert gateway.link.pending == 2
        assert gateway.count("gateway_redis_fallbacks_total", operation="record") == 3
        await gateway.settle()
        assert await gateway.index.shared.match(MODEL, CHAIN) == {"a:1": 40, "b:2": 40}
        await gateway.link.close()

    asyncio.run(scenario())


def test_at_maxmemory_the_least_recently_written_blocks_go_first() -> None:
    # A key expires by its newest stamp (one per refresh period): volatile-ttl evicts what was
    # written in the oldest periods first.
    with RedisServer("--maxmemory", "2mb", "--maxmemory-policy", "volatile-ttl") as server:

        async def scenario() -> None:
            gateway = Gateway(server.url, "ns")
            await gateway.link.start()
            # Every prompt in a refresh period of its own, as turns minutes apart would be.
            index = RedisPrefixIndex(gateway.link.client, KeySpace("ns"), 600, refresh=0.004)
            chains = [
                [prompt * 1000 + block for block in range(1, 101)] for prompt in range(1, 300)
            ]
            for chain in chains:
                await index.record(MODEL, "a:1", chain)
                await asyncio.sleep(0.005)
            info = await gateway.link.client.info()
            assert info["evicted_keys"] > 0
            depths = [(await index.match(MODEL, chain)).get("a:1", 0) for chain in chains]
            assert sum(depths[:50]) < sum(depths[-50:]) / 4
            assert depths[-1] == 100
            assert gateway.count("gateway_redis_errors_total") == 0
            await gateway.link.close()

        asyncio.run(scenario())


def index_prefix(chain: list[int]) -> bytes:
    return KeySpace("ns").block_prefix(MODEL, chain[0])


def test_a_chain_expires_from_its_end_though_its_beginning_was_written_first(
    server: RedisServer,
) -> None:
    async def scenario() -> None:
        client = open_client(server.url, 1.0, 2)
        clock = ManualClock(1_800_000_000.0)  # the start of a refresh period
        index = RedisPrefixIndex(client, KeySpace("ns"), 600, clock)
        await index.record(MODEL, "a:1", CHAIN[:20])
        clock.advance(10)  # the next turn, in the same refresh period: blocks 1-20 are kept
        await index.record(MODEL, "a:1", CHAIN)
        prefix = index_prefix(CHAIN)
        ttls = [await client.pttl(prefix + pack_hashes([block])) for block in CHAIN]
        # Block 21 on were written 10 s later, yet expire before the root and block 20.
        assert ttls[0] > ttls[19] > ttls[20] > ttls[39] > 0
        assert max(ttls) <= (600 + 30) * 1000
        await client.aclose()

    asyncio.run(scenario())


def test_a_write_restores_an_evicted_first_block(server: RedisServer) -> None:
    async def scenario() -> None:
        client = open_client(server.url, 1.0, 2)
        index = RedisPrefixIndex(client, KeySpace("ns"), 600)
        await index.record(MODEL, "a:1", CHAIN)
        prefix = index_prefix(CHAIN)
        await client.delete(prefix + pack_hashes(CHAIN[:1]))
        assert await index.match(MODEL, CHAIN) == {}
        # Blocks 2-40 carry this period's stamp already; the first one is written again.
        await index.record(MODEL, "a:1", CHAIN)
        assert await index.match(MODEL, CHAIN) == {"a:1": 40}
        await client.aclose()

    asyncio.run(scenario())


def test_a_missing_middle_block_never_yields_a_block_without_an_entry(
    server: RedisServer,
) -> None:
    # Binary search over a chain with holes (keys evicted): the depth is at least the first
    # hole's (a linear scan's answer), at most the deepest block still held, and always a
    # block the backend holds. Deeper than the first hole is right for an evicted key: the
    # entry there was written with every block before it.
    async def scenario() -> None:
        client = open_client(server.url, 1.0, 2)
        index = RedisPrefixIndex(client, KeySpace("ns"), 600)
        prefix = index_prefix(CHAIN)
        await index.record(MODEL, "a:1", CHAIN)
        await index.record(MODEL, "b:2", CHAIN[:30])
        for position in (19, 39):  # blocks 20 and 40
            await client.delete(prefix + pack_hashes(CHAIN[position : position + 1]))
        matched = await index.match(MODEL, CHAIN)
        assert 19 <= matched["a:1"] <= 39 and matched["a:1"] != 20
        assert 19 <= matched["b:2"] <= 30 and matched["b:2"] != 20
        await client.aclose()

    asyncio.run(scenario())


def test_an_error_reply_fails_one_operation_and_keeps_the_link_up() -> None:
    with RedisServer("--maxmemory-policy", "noeviction") as server:

        async def scenario() -> None:
            gateway = Gateway(server.url, "ns")
            await gateway.link.start()
            await gateway.learn(MODEL, "a:1", CHAIN)
            await gateway.settle()
            server.cli("config", "set", "maxmemory", "1")  # full: every write is refused
            await gateway.learn(MODEL, "b:2", list(range(5001, 5100)))
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


# The counts others wrote are read for this long (a second in a gateway): long enough here for
# the syncs below on a busy machine.
STALE_MS = 5_000


def test_gateways_see_each_others_requests_in_flight(server: RedisServer) -> None:
    async def scenario() -> None:
        probes = httpx.AsyncClient(timeout=PATIENCE_SECONDS)
        gateways = []
        for _ in range(3):
            gateway = Gateway(server.url, "ns")
            await gateway.link.start()
            pool = BackendPool()
            for name in ("a:1", "b:2"):
                pool.add(Backend(name, f"http://{name}", frozenset({MODEL}), healthy=True))
            engine_load = EngineLoadScraper(pool, probes, 0)
            link = gateway.link
            keys = KeySpace("ns")
            fleet = SharedLoad(link.client, link, keys, pool, engine_load, stale_ms=STALE_MS)
            gateways.append((gateway, pool, fleet))
        (_, first_pool, first_fleet), (_, second_pool, second_fleet) = gateways[:2]
        third_gateway, third_pool, third_fleet = gateways[2]
        first, second = first_pool.backends, second_pool.backends
        for backend in [first[0]] * 3 + [second[0]] + [second[1]] * 2:  # requests in flight
            backend.leased()
        written = time.monotonic()
        for _, _, fleet in gateways:
            await fleet.sync()
        await first_fleet.sync()
        # Each sees the others' requests, never its own.
        assert [backend.queued for backend in first_pool.backends] == [1, 2]
        assert [backend.queued for backend in third_pool.backends] == [4, 2]
        assert [backend.load for backend in first_pool.backends] == [4, 2]
        # A gateway that stopped writing stops counting once its last write is stale, not
        # before.
        while True:
            await first_fleet.sync()
            if [backend.queued for backend in first_pool.backends] == [0, 0]:
                break
            assert time.monotonic() - written < 30, "the silent gateways' counts kept"
            await asyncio.sleep(0.05)
        assert time.monotonic() - written >= STALE_MS / 1000
        # With Redis away, the others' counts are dropped rather than kept stale.
        await second_fleet.sync()
        await third_fleet.sync()
        assert third_pool.backends[0].queued == 4
        await third_gateway.link.close()
        await third_fleet.sync()
        assert third_pool.backends[0].queued == 0
        for gateway, _, _ in gateways[:2]:
            await gateway.link.close()
        await probes.aclose()

    asyncio.run(scenario())


def test_a_burst_of_forgets_takes_one_write_slot(server: RedisServer) -> None:
    async def scenario() -> None:
        gateway = Gateway(server.url, "ns", max_pending=2)
        await gateway.link.start()
        chains = [[prompt * 1000 + block for block in range(1, 11)] for prompt in range(2, 102)]
        for chain in chains:
            await gateway.learn(MODEL, "a:1", chain)
            await gateway.settle()
        # Cache feedback forgets every chain through one evicted block at once.
        for chain in chains:
            await gateway.index.forget(MODEL, "a:1", chain[5:])
        await gateway.learn(MODEL, "b:2", CHAIN)
        await gateway.settle()
        assert gateway.count("gateway_redis_fallbacks_total") == 0
        for chain in (chains[0], chains[-1]):
            assert await gateway.index.shared.match(MODEL, chain) == {"a:1": 5}
        assert await gateway.index.shared.match(MODEL, CHAIN) == {"b:2": 40}
        await gateway.link.close()

    asyncio.run(scenario())
