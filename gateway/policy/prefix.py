"""The `prefix` policy: send a request where its prefix is cached, without hot spots.

Algorithm, for the candidates (healthy backends serving the model) and the load bound
`B = max(floor, ceil(c · (total load + 1) / n))`:

1. Session: an explicit session key whose backend is a candidate within B keeps it.
2. Private owner: a backend whose match reaches into the request's own part (past the first
   user message: a conversation's history) and is clearly deeper than every other backend (by
   `clear_margin_blocks`) keeps the request up to a looser bound that grows with the share of
   the prompt only it holds: moving it would recompute that share elsewhere, for nothing.
3. Prefix: among holders of a match of at least `min_match_blocks` that are within B, the
   deepest wins; equal depths (a shared system prompt) go to the least loaded, then the one
   with the fewest recent requests, then the ring keyed on the first block after the shared
   depth — a per-conversation key — so ties spread instead of piling on "the first". Under
   load (total load ≥ n) a backend whose recent request count exceeds `recent_cap` × the mean
   is passed over, so a hot shared prefix keeps spreading.
4. Overflow: holders exist but none may take the request ⇒ the deepest other backend within B
   (same tie-breaks) takes it and becomes a holder, so a popular prefix spreads to as many
   backends as its traffic needs and no more.
5. Hash: no worthwhile match ⇒ walk the ring from the affinity key to the first backend
   within B and, under load, not over the recent cap (`hash` if it is the key's own backend,
   `overflow` otherwise).
6. Fallback: nothing within B ⇒ the least loaded candidate (B always admits the least loaded,
   so this is a guard, not a path traffic takes).

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
        recent_cap: float = 1.1,
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
        ring = self._rings.get(candidates)
        hot = self._hot(state, total_load)
        if max(depth_of.values(), default=0) >= self._min_match:
            owner = self._private_owner(state, depth_of, bound)
            if owner is not None:
                return Decision(owner, Route.PREFIX, depth_of[owner], bound)
            within = [name for name in candidates if within_bound(loads.get(name, 0), bound)]
            holders = [
                name for name in within if depth_of[name] >= self._min_match and name not in hot
            ]
            if holders:
                chosen = self._spread(state, holders, depth_of, ring)
                return Decision(chosen, Route.PREFIX, depth_of[chosen], bound)
            spill_to = [name for name in within if name not in hot] or within
            if spill_to:
                chosen = self._spread(state, spill_to, depth_of, ring)
                return Decision(chosen, Route.OVERFLOW, depth_of[chosen], bound)
        else:
            # A new prefix goes to its ring position, unless that backend is over the bound
            # or, under load, already busier than its share: then to the next one clockwise.
            first_fit = None
            for position, name in enumerate(ring.walk(state.affinity_key)):
                if within_bound(loads.get(name, 0), bound):
                    route = Route.HASH if position == 0 else Route.OVERFLOW
                    if name not in hot:
                        return Decision(name, route, depth_of[name], bound)
                    first_fit = first_fit or Decision(name, route, depth_of[name], bound)
            if first_fit is not None:
                return first_fit

        least = min(candidates, key=lambda name: loads.get(name, 0))
        return Decision(least, Route.FALLBACK, depth_of[least], bound)

    def _private_owner(
        self, state: RoutingState, depth_of: dict[str, int], bound: int
    ) -> str | None:
        """The one backend holding clearly more of the request's own history than any other."""
        owner = max(depth_of, key=lambda name: depth_of[name])
        depth = depth_of[owner]
        if depth <= state.private_from:
            return None
        runner_up = max((other for name, other in depth_of.items() if name != owner), default=0)
        exclusive = depth - runner_up
        if exclusive < self._margin:
            return None
        share = exclusive / max(len(state.hashes), depth, 1)
        loose_bound = math.ceil(bound * (1.0 + share * (self._factor * 2 - 1)))
        if within_bound(state.loads.get(owner, 0), max(bound, loose_bound)):
            return owner
        return None

    def _hot(self, state: RoutingState, total_load: int) -> set[str]:
        """Backends whose recent request count runs well above the mean, under load only.

        At low load affinity is free, and capping it there breaks long conversations.
        """
        if total_load < len(state.candidates) or not state.recent:
            return set()
        mean = sum(state.recent.get(name, 0.0) for name in state.candidates) / len(state.candidates)
        cap = self._recent_cap * mean
        return {name for name in state.candidates if state.recent.get(name, 0.0) > cap}

    def _spread(
        self,
        state: RoutingState,
        names: Sequence[str],
        depth_of: dict[str, int],
        ring: HashRing,
    ) -> str:
        """The deepest of `names`; ties to the least loaded, least recent, then ring order."""
        deepest = max(depth_of[name] for name in names)
        tied = [name for name in names if depth_of[name] == deepest]
        if len(tied) == 1:
            return tied[0]
        order = {
            name: position for position, name in enumerate(ring.walk(_key_after(state, deepest)))
        }
        loads = state.loads
        return min(
            tied,
            key=lambda name: (loads.get(name, 0), round(state.recent.get(name, 0.0)), order[name]),
        )


def _key_after(state: RoutingState, depth: int) -> int:
    """The hash of the first block past `depth`: it tells apart requests sharing that prefix."""
    if depth < len(state.hashes):
        return state.hashes[depth]
    return state.affinity_key
