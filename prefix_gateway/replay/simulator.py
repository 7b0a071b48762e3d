"""The replay loop: a trace through one routing policy and simulated replicas, in virtual
time, from one event heap; a run is a pure function of its inputs (docs/replay.md).
"""

from __future__ import annotations

import asyncio
import heapq
import random
from collections import defaultdict
from dataclasses import dataclass, field

from prefix_gateway.clock import ManualClock
from prefix_gateway.config import Settings
from prefix_gateway.emulator.prefix_cache import PrefixCache
from prefix_gateway.emulator.timing import TimeModel
from prefix_gateway.replay.oracle import OracleRouter
from prefix_gateway.replay.replicas import Flight, SimulatedReplica
from prefix_gateway.replay.routing import PolicyRouter, ReplayRouter
from prefix_gateway.replay.traces import Trace
from prefix_gateway.routing.policies import POLICIES, Policy, Route, build_policy
from prefix_gateway.routing.ring import load_bound
from prefix_gateway.state.index import InMemoryPrefixIndex

ORACLE = "oracle"
ROUTERS = (*POLICIES, ORACLE)

_PREFILLED, _FINISHED, _ARRIVED = 0, 1, 2


@dataclass(frozen=True)
class ReplayConfig:
    replicas: int = 8
    cache_tokens: int = 1 << 20
    time_model: TimeModel = field(default_factory=TimeModel)
    max_running: int = 64
    seed: int = 0
    load_factor: float = Settings.load_factor
    """The bound's c, for the policies and the oracle alike (the gateway's default)."""
    load_floor: int = Settings.load_floor
    max_loras: int = 2
    """LoRA adapters a replica keeps resident at once (vLLM's `--max-loras`)."""

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.max_running < 1 or self.max_loras < 1:
            raise ValueError("replicas, max_running and max_loras must be at least 1")
        if self.load_factor < 1.0 or self.load_floor < 1:
            raise ValueError("the load factor must be at least 1 and the floor at least 1")


@dataclass(frozen=True, slots=True)
class Served:
    """One request as the run saw it."""

    arrival: float
    backend: str
    route: Route
    load: int
    """The replica's requests in flight once this one joined."""
    bound: int
    """The gateway's load bound when it was placed (c and floor as configured)."""
    prompt_tokens: int
    cached_tokens: int
    ttft: float
    finished: float
    """When its last token came out: it counted in its replica's load until then."""
    shape: str = ""
    adapter: str = ""
    swapped: bool = False
    """Its adapter evicted another from the replica's slots."""


@dataclass(frozen=True)
class RunResult:
    policy: str
    replicas: tuple[str, ...]
    served: list[Served]


def replica_names(count: int) -> list[str]:
    return [f"replica-{number}" for number in range(count)]


def run_replay(
    trace: Trace, policy: str, config: ReplayConfig, experiment: Policy | None = None
) -> RunResult:
    """Replay `trace` through `policy` (a gateway policy name, or "oracle"), or through the
    policy object `experiment` reported under that name."""
    if experiment is None and policy not in ROUTERS:
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(ROUTERS)}")
    return asyncio.run(_run(trace, policy, config, experiment))


async def _run(
    trace: Trace, policy: str, config: ReplayConfig, experiment: Policy | None
) -> RunResult:
    names = replica_names(config.replicas)
    # The gateway's defaults (index TTL and size, minimum match) at the trace's block size,
    # with the bound under study; the oracle takes only the bound from them.
    settings = Settings(
        policy=policy if policy in POLICIES else "prefix",
        block_tokens=trace.block_tokens,
        load_factor=config.load_factor,
        load_floor=config.load_floor,
    )
    capacity = config.cache_tokens // trace.block_tokens
    if capacity < 1:
        raise ValueError("the cache must hold at least one block")
    replicas = {
        name: SimulatedReplica(
            name,
            PrefixCache(capacity, trace.block_tokens),
            config.time_model,
            config.max_running,
            config.max_loras,
        )
        for name in names
    }
    _check_fits(trace, next(iter(replicas.values())))
    clock = ManualClock()
    router: ReplayRouter
    if policy == ORACLE and experiment is None:
        caches = {name: replica.cache for name, replica in replicas.items()}
        router = OracleRouter(caches, settings.load_factor, settings.load_floor)
    else:
        index = InMemoryPrefixIndex(settings.affinity_ttl, settings.index_max_blocks, clock)
        chosen = experiment or build_policy(settings, random.Random(config.seed))
        router = PolicyRouter(names, chosen, index, clock, settings)
    served = await _simulate(trace, router, replicas, clock, settings)
    return RunResult(policy, tuple(names), served)


def _check_fits(trace: Trace, replica: SimulatedReplica) -> None:
    for position, request in enumerate(trace.requests):
        if not replica.fits(request):
            raise ValueError(
                f"request {position} ({request.prompt_tokens} + {request.output_tokens} tokens) "
                f"can never fit a cache of {replica.cache.capacity_blocks} blocks of "
                f"{trace.block_tokens} tokens; raise the cache size"
            )


async def _simulate(
    trace: Trace,
    router: ReplayRouter,
    replicas: dict[str, SimulatedReplica],
    clock: ManualClock,
    settings: Settings,
) -> list[Served]:
    requests = trace.requests
    followers: defaultdict[int, list[int]] = defaultdict(list)
    events: list[tuple[float, int, int, Flight | None]] = []
    sequence = 0
    for position, request in enumerate(requests):
        if request.after is None:
            events.append((request.arrival, _ARRIVED, position, None))
        else:
            followers[request.after].append(position)
    heapq.heapify(events)
    # Arrivals are numbered by trace position, everything else after them, so equal times
    # resolve the same way in every run.
    sequence = len(requests)
    loads = dict.fromkeys(replicas, 0)
    flights: list[Flight | None] = [None] * len(requests)
    bounds = [0] * len(requests)
    placed_loads = [0] * len(requests)

    def schedule(started: list[Flight]) -> None:
        nonlocal sequence
        for flight in started:
            heapq.heappush(events, (flight.first_token_at, _PREFILLED, sequence, flight))
            heapq.heappush(events, (flight.done_at, _FINISHED, sequence + 1, flight))
            sequence += 2

    while events:
        now, kind, number, flight = heapq.heappop(events)
        clock.now = now
        if kind == _ARRIVED:
            request = requests[number]
            total = sum(loads.values())
            decision = await router.route(request, dict(loads))
            loads[decision.backend] += 1
            bounds[number] = load_bound(
                total, len(loads), settings.load_factor, settings.load_floor
            )
            placed_loads[number] = loads[decision.backend]
            arriving = Flight(number, request, decision, now)
            flights[number] = arriving
            schedule(replicas[decision.backend].arrive(arriving, now))
        elif kind == _PREFILLED:
            assert flight is not None
            replicas[flight.backend].prefilled(flight)
            router.prefilled(flight.request, flight.decision)
        else:
            assert flight is not None
            loads[flight.backend] -= 1
            schedule(replicas[flight.backend].finish(flight, now))
            await router.answered(flight.request, flight.backend)
            for follower in followers.get(flight.position, ()):
                arrival = now + requests[follower].arrival
                heapq.heappush(events, (arrival, _ARRIVED, follower, None))

    return [
        Served(
            arrival=flight.arrived_at,
            backend=flight.backend,
            route=flight.decision.route,
            load=placed_loads[flight.position],
            bound=bounds[flight.position],
            prompt_tokens=flight.request.prompt_tokens,
            cached_tokens=flight.cached_tokens,
            ttft=flight.first_token_at - flight.arrived_at,
            finished=flight.done_at,
            shape=flight.request.shape,
            adapter=flight.request.adapter,
            swapped=flight.swapped,
        )
        for flight in flights
        if flight is not None
    ]
