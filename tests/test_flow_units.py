"""Flow control's rules one at a time, in-process: the real `Flow` with a gateway's own pool,
router and tenants, each request taken through its life as the proxy takes it (its tenant's
reservation, its turn, its placement among the replicas with a free slot, its slot; at its end
its charge, which the fair queue counts as service). No replica is asked: a request is in
flight from its placement until the test ends it, with the usage the test says the engine
reported. What the other gateways of a fleet have in flight comes through a real Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import httpx
import orjson
import pytest

from prefix_gateway.backends.backend import Backend
from prefix_gateway.backends.engine_load import EngineLoadScraper
from prefix_gateway.backends.pool import BackendPool, Lease
from prefix_gateway.backends.shared_load import SharedLoad
from prefix_gateway.config import Settings
from prefix_gateway.config.tenants import TenantSpec
from prefix_gateway.metrics import Metrics
from prefix_gateway.prompt.parsing import Endpoint, RoutingInput, parse_request
from prefix_gateway.proxy.flow import Flow, Ticket
from prefix_gateway.proxy.tenancy import Account, Tenancy
from prefix_gateway.routing.placement import Placement
from prefix_gateway.routing.policies import build_policy
from prefix_gateway.routing.recorder import Stores
from prefix_gateway.routing.router import Router
from prefix_gateway.routing.types import Outcome
from prefix_gateway.state.index import InMemoryPrefixIndex
from prefix_gateway.state.redis import KeySpace, RedisLink, open_client
from prefix_gateway.state.sessions import InMemorySessionStore
from tests.redis_server import RedisServer
from tests.support import PATIENCE_SECONDS, eventually

MODEL = "m"
TENANTS = ("busy", "quiet", "thrifty", "lavish", "filler")


class Gateway:
    """What one gateway process holds for flow control: its pool of replicas, router, tenants
    (keyed in `TENANTS` order) and flow, with `capacity` slots per replica."""

    def __init__(self, capacity: int, replicas: int) -> None:
        names = tuple(f"r{number}:{8000 + number}" for number in range(replicas))
        specs = tuple(TenantSpec(name, f"{name}-key") for name in TENANTS)
        # A load floor above any count here: the load bound never moves a request, so where
        # one goes is flow control's doing.
        self.settings = Settings(
            backend=names,
            max_inflight_per_replica=capacity,
            tenants=specs,
            load_floor=100,
            queue_timeout=300,
        )
        self.pool = BackendPool()
        for name in names:
            self.pool.add(Backend(name, f"http://{name}", frozenset({MODEL}), healthy=True))
        self.metrics = Metrics()
        stores = Stores(InMemoryPrefixIndex(600, 100_000), InMemorySessionStore(600, 1000))
        settings, pool, metrics = self.settings, self.pool, self.metrics
        self.router = Router(settings, pool, stores, build_policy(settings), metrics)
        self.tenancy = Tenancy(settings, metrics, pool, None)
        self.flow = Flow(settings, pool, metrics)

    def replica(self, number: int) -> Backend:
        return self.pool.backends[number]

    def request(self, tenant: str, prompt: str, max_tokens: int = 16) -> Request:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
        }
        parsed = parse_request(Endpoint.CHAT, orjson.dumps(body), None)
        return Request(self, parsed, self.tenancy.account(TENANTS.index(tenant)))


@dataclass(eq=False)
class Request:
    """One request's life under flow control, as `RequestLife` lives it."""

    gateway: Gateway
    parsed: RoutingInput
    account: Account
    ticket: Ticket | None = None
    placement: Placement | None = None

    async def placed(self) -> Placement:
        """Admitted, given its turn and placed: `RequestLife._placed`."""
        gateway = self.gateway
        await self.account.admit(self.parsed)
        placing = gateway.router.placing(self.parsed)
        flow = gateway.flow
        ticket = self.ticket = flow.enter(*self.account.lane, self.account.reserved, MODEL)
        ticket.pinned = placing.pinned
        self.placement = await flow.place(ticket, placing)
        return self.placement

    def start(self) -> asyncio.Task[Placement]:
        return asyncio.create_task(self.placed())

    async def end(self, prompt: int, cached: int = 0, completion: int = 1) -> float:
        """Answered, the engine reporting `prompt` tokens of which `cached` came from its cache:
        settled and given back as `RequestLife._end` does; the service counted for it."""
        placement, ticket = self.placement, self.ticket
        assert placement is not None and ticket is not None
        outcome = Outcome(
            200,
            placement.decision,
            (placement.backend.name,),
            prompt_tokens=prompt,
            cached_tokens=cached,
            completion_tokens=completion,
            accepted=(placement.backend.name,),
            answered=True,
        )
        served = self.account.settle(self.parsed, 200, outcome)
        self.gateway.flow.release(ticket, served)
        await placement.settle(outcome)
        return served


@contextlib.asynccontextmanager
async def flowing(capacity: int, replicas: int) -> AsyncIterator[Gateway]:
    """A `Gateway` whose flow gives turns until the block ends."""
    gateway = Gateway(capacity, replicas)
    gateway.flow.start()
    try:
        yield gateway
    finally:
        await gateway.flow.stop()


def words(count: int, tag: str) -> str:
    return " ".join(f"{tag}{number}" for number in range(count))


async def placement_of(task: asyncio.Task[Placement], what: str) -> Placement:
    """`task`'s placement once it has one, within the suite's patience (not the queue's)."""
    await eventually(task.done, what)
    return task.result()


def test_a_slot_is_kept_for_a_quiet_tenant_while_a_busy_one_waits() -> None:
    """Two replicas of two slots: a quarter of them (one) is kept for a tenant active lately
    with nothing in flight, so that its next request does not queue behind a busy tenant's."""

    async def scenario() -> None:
        async with flowing(capacity=2, replicas=2) as gateway:
            # The quiet tenant sent one request a moment ago, answered since.
            earlier = gateway.request("quiet", "hello")
            await earlier.placed()
            await earlier.end(prompt=3)
            busy = [gateway.request("busy", f"busy {number}").start() for number in range(5)]
            await eventually(
                lambda: (
                    sum(task.done() for task in busy) == 3 and gateway.flow.waiting_of("busy") == 2
                ),
                "three placed, two waiting",
            )
            # The busy tenant's fourth request waits though a slot is free: the slot is kept
            # for the quiet tenant, whose next request takes it.
            await placement_of(gateway.request("quiet", "one more").start(), "quiet placed")
            assert gateway.flow.waiting_of("busy") == 2
            assert sum(backend.in_flight for backend in gateway.pool.backends) == 4

    asyncio.run(scenario())


async def waiting_for_its_holder(gateway: Gateway) -> tuple[Request, asyncio.Task[Placement]]:
    """A request placed on one replica, which it fills, and another of the same long prefix,
    waiting although the other replica has a free slot."""
    shared = words(400, "manual")
    first = gateway.request("busy", shared + " first question")
    holder = (await first.placed()).backend
    again = gateway.request("quiet", shared + " second question").start()
    await eventually(lambda: gateway.flow.waiting_of("quiet") == 1, "waiting")
    other = next(backend for backend in gateway.pool.backends if backend is not holder)
    assert gateway.flow.room(other) and not gateway.flow.room(holder)
    return first, again


def test_a_request_waits_for_the_busy_replica_holding_its_prefix() -> None:
    """The replica holding a prompt's prefix is full and another has a free slot: the request
    waits for the holder (sent elsewhere, it would compute the prefix anew) and is placed there
    once a slot frees."""

    async def scenario() -> None:
        async with flowing(capacity=1, replicas=2) as gateway:
            first, again = await waiting_for_its_holder(gateway)
            await first.end(prompt=410)
            placement = await placement_of(again, "placed once the holder freed")
            assert first.placement is not None
            assert placement.backend is first.placement.backend
            assert placement.decision.route.value in {"owner", "prefix"}

    asyncio.run(scenario())


def test_a_request_waits_for_its_prefixs_holder_only_so_long() -> None:
    """While the holder stays full, the wait ends within its bound (seconds, not the queue's
    timeout): the request goes to the replica with a free slot."""

    async def scenario() -> None:
        async with flowing(capacity=1, replicas=2) as gateway:
            first, again = await waiting_for_its_holder(gateway)
            placement = await placement_of(again, "placed elsewhere")
            assert first.placement is not None
            holder = first.placement.backend
            assert placement.backend is not holder
            assert holder.in_flight == 1  # the holder never freed: the bound ended the wait
            assert gateway.settings.queue_timeout == 300

    asyncio.run(scenario())


def test_service_is_what_was_charged_with_cached_tokens_cheap_not_what_was_reserved() -> None:
    """The fair queue serves first the tenant that received the least service: once requests
    settle, what they were charged (cached prompt tokens at `cached_token_cost`), not what
    they reserved. The thrifty tenant reserved far more than the lavish one, but its prompt
    came from the engine's cache: its service is the smaller, and its request waiting behind
    the lavish one's goes first."""

    async def scenario() -> None:
        async with flowing(capacity=1, replicas=1) as gateway:
            thrifty = gateway.request("thrifty", words(700, "cached"), max_tokens=1000)
            await thrifty.placed()
            thrifty_served = await thrifty.end(prompt=1000, cached=960, completion=10)
            lavish = gateway.request("lavish", words(150, "fresh"), max_tokens=10)
            await lavish.placed()
            lavish_served = await lavish.end(prompt=200, cached=0, completion=10)
            # Charged: 40 + 960 x 0.1 + 10 = 146 against 210, though it reserved over 1,000.
            assert thrifty.account.reserved > 1000
            assert thrifty_served == pytest.approx(146)
            assert lavish_served == 210
            # A third tenant's request holds the only slot while both queue, lavish first.
            filler = gateway.request("filler", "hold the slot")
            await filler.placed()
            lavish_next = gateway.request("lavish", "next")
            thrifty_next = gateway.request("thrifty", "next")
            lavish_waits = lavish_next.start()
            await eventually(lambda: gateway.flow.waiting_of("lavish") == 1, "lavish waiting")
            thrifty_waits = thrifty_next.start()
            await eventually(lambda: gateway.flow.waiting_of("thrifty") == 1, "thrifty waiting")
            await filler.end(prompt=3)
            await placement_of(thrifty_waits, "thrifty placed")
            assert gateway.flow.waiting_of("lavish") == 1
            await thrifty_next.end(prompt=3)
            await placement_of(lavish_waits, "lavish placed")

    asyncio.run(scenario())


class FleetMember:
    """A gateway of a fleet: its `Gateway`, and the exchange of its requests in flight per
    replica with the others' through Redis, as `serve --redis-url` runs it."""

    def __init__(self, url: str, probes: httpx.AsyncClient) -> None:
        self.gateway = Gateway(capacity=2, replicas=1)
        metrics = self.gateway.metrics
        # A deadline no busy machine reaches: an exchange that timed out would drop the
        # others' counts, which is not what these tests are about.
        self.link = RedisLink(open_client(url, 10, max_connections=4), 10, metrics, 16)
        self.engine_load = EngineLoadScraper(self.gateway.pool, probes, 0)
        self.exchange = SharedLoad(
            self.link.client, self.link, KeySpace("flow"), self.gateway.pool, self.engine_load
        )


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as started:
        yield started


def test_another_gateways_requests_on_a_replica_take_its_slots_here(
    redis_server: RedisServer,
) -> None:
    """Two slots per replica: with another gateway's two requests in flight on the one
    replica, as the exchange through Redis tells, none is left here and a request waits;
    once that gateway's requests end and it says so, the request is placed."""

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=PATIENCE_SECONDS) as probes:
            here, there = (
                FleetMember(redis_server.url, probes),
                FleetMember(redis_server.url, probes),
            )
            for member in (here, there):
                await member.link.start()
            flow = here.gateway.flow
            flow.start()
            try:
                elsewhere = [Lease(there.gateway.replica(0)).take() for _ in range(2)]
                await there.exchange.sync()
                await here.exchange.sync()
                replica = here.gateway.replica(0)
                assert (replica.in_flight, replica.queued) == (0, 2)
                assert not flow.room(replica)
                waiting = here.gateway.request("busy", "hello").start()
                await eventually(lambda: flow.waiting_of("busy") == 1, "waiting")
                for lease in elsewhere:
                    lease.release()
                await there.exchange.sync()
                await here.exchange.sync()
                placement = await placement_of(waiting, "placed once the others ended")
                assert placement.backend is replica and replica.in_flight == 1
            finally:
                await flow.stop()
                for member in (here, there):
                    await member.link.close()

    asyncio.run(scenario())
