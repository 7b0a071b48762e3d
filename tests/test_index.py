"""The contract every PrefixIndex and SessionStore implementation must keep."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import pytest

from prefix_gateway.clock import ManualClock
from prefix_gateway.state.index import InMemoryPrefixIndex, PrefixIndex
from prefix_gateway.state.sessions import InMemorySessionStore, SessionStore
from tests.redis_server import (
    RedisClusterServers,
    RedisServer,
    close_opened_clients,
    redis_index_factory,
    redis_session_factory,
)

IndexFactory = Callable[[ManualClock, float, int], PrefixIndex]
SessionFactory = Callable[[ManualClock, float, int], SessionStore]

INDEXES: dict[str, IndexFactory] = {
    "memory": lambda clock, ttl, size: InMemoryPrefixIndex(ttl, size, clock),
}
SESSIONS: dict[str, SessionFactory] = {
    "memory": lambda clock, ttl, size: InMemorySessionStore(ttl, size, clock),
}
# Implementations on a server the `<name>_url` fixture starts: name -> (URL -> factory). They
# are bounded by the server's maxmemory, not by a count, so the size tests run on the others only.
SHARED_INDEXES: dict[str, Callable[[str], IndexFactory]] = {
    "redis": redis_index_factory,
    "redis_cluster": redis_index_factory,
}
SHARED_SESSIONS: dict[str, Callable[[str], SessionFactory]] = {
    "redis": redis_session_factory,
    "redis_cluster": redis_session_factory,
}


def run(coroutine: Coroutine[Any, Any, Any]) -> Any:
    async def then_close() -> Any:
        try:
            return await coroutine
        finally:
            await close_opened_clients()

    return asyncio.run(then_close())


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with RedisServer() as server:
        yield server.url


@pytest.fixture(scope="module")
def redis_cluster_url() -> Iterator[str]:
    with RedisClusterServers() as cluster:
        yield cluster.url


@pytest.fixture(params=[*sorted(INDEXES), *sorted(SHARED_INDEXES)])
def make_index(request: pytest.FixtureRequest) -> IndexFactory:
    if request.param in SHARED_INDEXES:
        url = request.getfixturevalue(f"{request.param}_url")
        return SHARED_INDEXES[request.param](url)
    return INDEXES[request.param]


@pytest.fixture(params=[*sorted(SESSIONS), *sorted(SHARED_SESSIONS)])
def make_sessions(request: pytest.FixtureRequest) -> SessionFactory:
    if request.param in SHARED_SESSIONS:
        url = request.getfixturevalue(f"{request.param}_url")
        return SHARED_SESSIONS[request.param](url)
    return SESSIONS[request.param]


@pytest.fixture(params=sorted(INDEXES))
def make_bounded_index(request: pytest.FixtureRequest) -> IndexFactory:
    return INDEXES[request.param]


@pytest.fixture(params=sorted(SESSIONS))
def make_bounded_sessions(request: pytest.FixtureRequest) -> SessionFactory:
    return SESSIONS[request.param]


def test_match_depth_per_backend(make_index: IndexFactory) -> None:
    index = make_index(ManualClock(), 600, 10_000)

    async def scenario() -> None:
        await index.record("m", "a", [1, 2, 3, 4, 5])
        await index.record("m", "b", [1, 2, 9])
        assert await index.match("m", [1, 2, 3, 4, 5, 6]) == {"a": 5, "b": 2}
        assert await index.match("m", [1, 2, 9, 10]) == {"a": 2, "b": 3}
        assert await index.match("m", [7, 1, 2]) == {}
        assert await index.match("other-model", [1, 2, 3]) == {}

    run(scenario())


def test_every_holder_is_remembered(make_index: IndexFactory) -> None:
    index = make_index(ManualClock(), 600, 10_000)

    async def scenario() -> None:
        for backend in ("a", "b", "c"):
            await index.record("m", backend, [1, 2, 3])
        assert await index.match("m", [1, 2, 3]) == {"a": 3, "b": 3, "c": 3}

    run(scenario())


def test_entries_expire_after_the_ttl_unless_touched(make_index: IndexFactory) -> None:
    clock = ManualClock()
    index = make_index(clock, 600, 10_000)

    async def scenario() -> None:
        await index.record("m", "a", [1, 2, 3])
        await index.record("m", "b", [1, 2, 3])
        clock.advance(500)
        await index.record("m", "b", [1, 2, 3])
        clock.advance(200)
        assert await index.match("m", [1, 2, 3]) == {"b": 3}
        clock.advance(601)
        assert await index.match("m", [1, 2, 3]) == {}

    run(scenario())


def test_forget_cuts_a_backend_at_the_first_forgotten_block(make_index: IndexFactory) -> None:
    index = make_index(ManualClock(), 600, 10_000)

    async def scenario() -> None:
        await index.record("m", "a", [1, 2, 3, 4])
        await index.record("m", "b", [1, 2, 3, 4])
        await index.forget("m", "a", [3, 4])
        assert await index.match("m", [1, 2, 3, 4]) == {"a": 2, "b": 4}

    run(scenario())


def test_a_forgotten_block_inside_a_chain_is_never_a_matched_depth(
    make_index: IndexFactory,
) -> None:
    # Feedback forgets the chains it knows through an evicted block; one it does not know (a
    # deeper prompt another gateway recorded) keeps its entries past the forgotten run. The
    # depth is then at least the first forgotten block's, at most the deepest held, and a
    # block the backend holds.
    index = make_index(ManualClock(), 600, 10_000)

    async def scenario() -> None:
        chain = list(range(1, 17))
        await index.record("m", "a", chain)
        await index.forget("m", "a", chain[5:9])
        depth = (await index.match("m", chain))["a"]
        assert 5 <= depth <= 16 and depth not in range(6, 10)
        await index.forget("m", "a", chain[2:])
        assert await index.match("m", chain) == {"a": 2}

    run(scenario())


def test_size_bound_drops_the_deepest_blocks_of_the_oldest_prompt(
    make_bounded_index: IndexFactory,
) -> None:
    index = make_bounded_index(ManualClock(), 600, 6)

    async def scenario() -> None:
        await index.record("m", "a", [1, 2, 3, 4])
        await index.record("m", "b", [11, 12, 13, 14])
        # The older prompt lost its end, never its beginning.
        assert await index.match("m", [1, 2, 3, 4]) == {"a": 2}
        assert await index.match("m", [11, 12, 13, 14]) == {"b": 4}

    run(scenario())


def test_sessions_stick_and_expire(make_sessions: SessionFactory) -> None:
    clock = ManualClock()
    sessions = make_sessions(clock, 600, 100)

    async def scenario() -> None:
        assert await sessions.get("s1") is None
        await sessions.put("s1", "a")
        clock.advance(599)
        assert await sessions.get("s1") == "a"
        await sessions.put("s1", "b")  # moved: the TTL restarts
        clock.advance(599)
        assert await sessions.get("s1") == "b"
        clock.advance(2)
        assert await sessions.get("s1") is None

    run(scenario())


def test_sessions_are_bounded(make_bounded_sessions: SessionFactory) -> None:
    sessions = make_bounded_sessions(ManualClock(), 600, 2)

    async def scenario() -> None:
        for key in ("s1", "s2", "s3"):
            await sessions.put(key, "a")
        assert await sessions.get("s1") is None
        assert await sessions.get("s3") == "a"

    run(scenario())
