"""The `prefix` policy: send a request where its prefix is cached, without hot spots.

Algorithm, for the candidates (healthy backends serving the model) and the load bound
`B = max(floor, ceil(c · (total load + 1) / n))`:

1. Session: an explicit session key whose backend is a candidate within B keeps it.
2. Prefix: among backends within B whose indexed match is at least `min_match_blocks`, the
   deepest wins. Equal depths (a shared system prompt every holder has) are broken by the least
   load, then the fewest recent requests, then the ring keyed on the first block after the
   shared depth — a per-conversation key — so ties spread instead of piling on "the first".
   Under load (total load ≥ n) a holder whose recent request count exceeds `recent_cap` × the
   mean is passed over, so a hot prefix keeps spreading once it is everywhere.
3. A backend clearly deeper than every other (by `clear_margin_blocks`) may keep its request
   beyond B, up to a looser bound that grows with the share of the prompt only it holds: moving
   it would recompute that share elsewhere.
4. Overflow: holders exist but none may take the request ⇒ the deepest backend within B (ties:
   ring order) takes it and becomes a holder, so a popular prefix spreads to as many backends
   as its traffic needs.
5. Hash: no worthwhile match ⇒ walk the ring from the affinity key to the first backend
   within B (`hash` if it is the key's own backend, `overflow` otherwise).
6. Fallback: nothing within B ⇒ the least loaded candidate.

Cost: O(n) over candidates plus O(log(n · vnodes)) for a ring walk; the index match that
produced `matched` is linear in the prompt's blocks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from gateway.policy.base import Decision, Route, RoutingState
from gateway.policy.rings import RingCache
from gateway.ring import HashRing, load_bound, within_bound


class PrefixPolicy:
    def __init__(
        self,
        load_factor: float = 1.25,
        load_floor: int = 2,
        min_match_blocks: int = 4,
        clear_margin_blocks: int = 4,
        recent_cap: float = 1.5,
    ) -> None:
        self._factor = load_factor
        self._floor = load_floor
        self._min_match = min_match_blocks
        self._margin = clear_margin_blocks
        self._recent_cap = recent_cap
        self._rings = RingCache()

    def choose(self, state: RoutingState) -> Decision:
        candidates = state.candidates
        loads = state.loads
        total_load = sum(loads.get(name, 0) for name in candidates)
        bound = load_bound(total_load, len(candidates), self._factor, self._floor)

        sticky = state.sticky
        if (
            sticky is not None
            and sticky in candidates
            and within_bound(loads.get(sticky, 0), bound)
        ):
            return Decision(sticky, Route.SESSION, state.matched.get(sticky, 0), bound)

        depth_of = {name: state.matched.get(name, 0) for name in candidates}
        deepest = max(depth_of.values(), default=0)
        ring = self._rings.get(candidates)
        if deepest >= self._min_match:
            holders = [name for name in candidates if depth_of[name] >= self._min_match]
            chosen = self._clear_owner(state, holders, depth_of, bound)
            if chosen is None:
                chosen = self._best_holder(state, holders, depth_of, bound, total_load, ring)
            if chosen is not None:
                return Decision(chosen, Route.PREFIX, depth_of[chosen], bound)
            spill = self._deepest_within(state, depth_of, bound, ring)
            if spill is not None:
                return Decision(spill, Route.OVERFLOW, depth_of[spill], bound)
        else:
            for position, name in enumerate(ring.walk(state.affinity_key)):
                if within_bound(loads.get(name, 0), bound):
                    route = Route.HASH if position == 0 else Route.OVERFLOW
                    return Decision(name, route, depth_of[name], bound)

        least = min(candidates, key=lambda name: loads.get(name, 0))
        return Decision(least, Route.FALLBACK, depth_of[least], bound)

    def _clear_owner(
        self, state: RoutingState, holders: Sequence[str], depth_of: dict[str, int], bound: int
    ) -> str | None:
        """The one backend holding clearly more of the prompt than any other, if it may take it."""
        owner = max(holders, key=lambda name: depth_of[name])
        runner_up = max((depth for name, depth in depth_of.items() if name != owner), default=0)
        exclusive = depth_of[owner] - runner_up
        if exclusive < self._margin:
            return None
        share = exclusive / max(len(state.hashes), depth_of[owner], 1)
        loose_bound = math.ceil(bound * (1.0 + share * (self._factor * 2 - 1)))
        if within_bound(state.loads.get(owner, 0), max(bound, loose_bound)):
            return owner
        return None

    def _best_holder(
        self,
        state: RoutingState,
        holders: Sequence[str],
        depth_of: dict[str, int],
        bound: int,
        total_load: int,
        ring: HashRing,
    ) -> str | None:
        loads = state.loads
        eligible = [name for name in holders if within_bound(loads.get(name, 0), bound)]
        if not eligible:
            return None
        if total_load >= len(state.candidates) and state.recent:
            mean_recent = sum(state.recent.get(name, 0.0) for name in state.candidates) / len(
                state.candidates
            )
            cap = self._recent_cap * mean_recent
            cooler = [name for name in eligible if state.recent.get(name, 0.0) <= cap]
            eligible = cooler or eligible
        deepest = max(depth_of[name] for name in eligible)
        tied = [name for name in eligible if depth_of[name] == deepest]
        if len(tied) == 1:
            return tied[0]
        spread_key = _key_after(state, deepest)
        order = {name: position for position, name in enumerate(ring.walk(spread_key))}
        return min(
            tied,
            key=lambda name: (loads.get(name, 0), round(state.recent.get(name, 0.0)), order[name]),
        )

    def _deepest_within(
        self, state: RoutingState, depth_of: dict[str, int], bound: int, ring: HashRing
    ) -> str | None:
        walk_order = list(ring.walk(_key_after(state, max(depth_of.values(), default=0))))
        eligible = [name for name in walk_order if within_bound(state.loads.get(name, 0), bound)]
        if not eligible:
            return None
        return max(eligible, key=lambda name: depth_of[name])


def _key_after(state: RoutingState, depth: int) -> int:
    """The hash of the first block past `depth`: it tells apart requests sharing that prefix."""
    if depth < len(state.hashes):
        return state.hashes[depth]
    return state.affinity_key
