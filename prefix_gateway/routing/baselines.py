"""Baseline policies, kept for comparison with `prefix` in benchmarks and replays."""

from __future__ import annotations

import random

from prefix_gateway.routing.ring import RingCache, load_bound, within_bound
from prefix_gateway.routing.types import Decision, Route, RoutingState


class ConsistentHashPolicy:
    """Bounded-load consistent hashing on the affinity key alone."""

    def __init__(self, load_factor: float, load_floor: int) -> None:
        self._factor = load_factor
        self._floor = load_floor
        self._rings = RingCache()

    def choose(self, state: RoutingState) -> Decision:
        bound = load_bound(state.summed_load(), len(state.candidates), self._factor, self._floor)
        ring = self._rings.get(state.members or state.candidates)
        for position, name in enumerate(ring.walk(state.affinity_key)):
            if within_bound(state.loads.get(name, 0), bound):
                route = Route.HASH if position == 0 else Route.OVERFLOW
                return Decision(name, route, state.matched.get(name, 0), bound)
        least = min(state.candidates, key=lambda name: state.loads.get(name, 0))
        return Decision(least, Route.FALLBACK, state.matched.get(least, 0), bound)


class LeastLoadedPolicy:
    def choose(self, state: RoutingState) -> Decision:
        best = min(state.candidates, key=lambda name: state.loads.get(name, 0))
        return Decision(best, Route.LEAST_LOADED, state.matched.get(best, 0))


class LeastLoadedInTurnPolicy:
    """The least loaded, ties taken in turn: for requests no replica can serve better than
    another (`/tokenize`, `/v1/score`...)."""

    def choose(self, state: RoutingState) -> Decision:
        candidates = state.candidates
        start = state.sequence % len(candidates)
        turn = [*candidates[start:], *candidates[:start]]
        best = min(turn, key=lambda name: state.loads.get(name, 0))
        return Decision(best, Route.LEAST_LOADED)


class RoundRobinPolicy:
    def choose(self, state: RoutingState) -> Decision:
        name = state.candidates[state.sequence % len(state.candidates)]
        return Decision(name, Route.ROUND_ROBIN, state.matched.get(name, 0))


class RandomPolicy:
    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def choose(self, state: RoutingState) -> Decision:
        name = self._rng.choice(list(state.candidates))
        return Decision(name, Route.RANDOM, state.matched.get(name, 0))
