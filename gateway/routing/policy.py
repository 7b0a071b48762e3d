"""The `prefix` policy: send a request where its prefix is cached, without hot spots.

Algorithm, for the candidates (healthy backends serving the model) and the load bound
`B = max(floor, ceil(c · (total load + 1) / n))`:

1. Session: an explicit session key whose backend is a candidate within B keeps it.
2. Owner: a backend whose match is clearly deeper than every other backend's (by
   `clear_margin_blocks`) keeps the request up to a looser bound that grows with the share of
   the prompt only it holds — moving it would recompute that share elsewhere, for nothing —
   when what it alone holds is the request's own history (past the first user message: a
   conversation), or a shared prompt that is not hot: one drawing at most the load factor
   times a replica's share of recent requests (a customer's own system prompt, say), held by
   a backend whose recent requests stay within the load factor times the mean. A hot shared
   prompt, or one whose holder is that busy, spreads instead (steps 3 and 4).
3. Prefix: among holders of a match of at least `min_match_blocks` that are within B, the
   deepest wins; equal depths (a shared system prompt) go to the least loaded, then the one
   with the fewest recent requests, then a hash of the first block after the shared depth — a
   per-conversation key — so ties spread instead of piling on "the first". Under load (total
   load ≥ n) a backend whose recent request count exceeds both `recent_cap` × the mean and the
   mean plus `recent_slack` is passed over, so a hot shared prefix keeps spreading; the slack
   keeps the handful of requests at start-up from counting as a trend.
4. Overflow: holders exist but none may take the request ⇒ the deepest other holder within B
   takes it, else the less loaded of the first two backends within B on the ring from the
   first block past the match (at equal loads, the one with less pending prefill, see step 5);
   it becomes a holder, so a popular prefix spreads to as many backends as its traffic needs
   and no more.
5. Hash: no worthwhile match ⇒ of the first `hash_choices` backends within B (and, under load,
   not hot) on the ring walked from the affinity key, the one with the least pending prefill
   (prompt blocks sent there and not computed yet), then the fewest recent requests (`hash`,
   or `overflow` when the walk passed over a backend to get there). The whole prompt is
   computed either way; behind a shorter queue of prefills it starts sooner, and it does not
   hold up the requests that hit the cache of a backend busy computing other prompts. Two
   choices instead of one keep new prefixes as balanced as the ring keeps them stable. A
   request with a session key takes the first of them: the first requests of a new session,
   sent at once or through several gateways, then agree before its binding is stored.
6. Fallback: nothing within B ⇒ the least loaded candidate (B always admits the least loaded,
   so this is a guard, not a path traffic takes).

Cost: O(m) over the m backends the index matched plus O(log(n · vnodes)) for a ring walk, when
the caller passes the candidates' set, summed load and summed recent counts (the router
does); the index match that produced `matched` is linear in the prompt's blocks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import xxhash

from gateway.routing.ring import HashRing, load_bound, within_bound
from gateway.routing.rings import RingCache
from gateway.routing.types import Decision, Route, RoutingState


class PrefixPolicy:
    def __init__(
        self,
        load_factor: float = 1.25,
        load_floor: int = 2,
        min_match_blocks: int = 4,
        clear_margin_blocks: int = 4,
        recent_cap: float = 1.1,
        recent_slack: float = 2.0,
        hash_choices: int = 2,
    ) -> None:
        self._factor = load_factor
        self._floor = load_floor
        self._min_match = min_match_blocks
        self._margin = clear_margin_blocks
        self._recent_cap = recent_cap
        self._recent_slack = recent_slack
        self._hash_choices = max(1, hash_choices)
        self._rings = RingCache()

    def choose(self, state: RoutingState) -> Decision:
        candidates = state.candidates
        members = state.members if state.members is not None else frozenset(candidates)
        loads = state.loads
        count = len(candidates)
        total_load = state.summed_load()
        bound = load_bound(total_load, count, self._factor, self._floor)
        shared_hot = state.shared_share > self._factor / max(count, 1)

        sticky = state.sticky
        if sticky is not None and sticky in members and within_bound(loads.get(sticky, 0), bound):
            return Decision(sticky, Route.SESSION, state.matched.get(sticky, 0), bound)

        depth_of = {
            name: depth for name, depth in state.matched.items() if depth > 0 and name in members
        }
        ring = self._rings.get(members)
        hot = self._hot_check(state, total_load, count)
        deepest = max(depth_of.values(), default=0)
        if deepest >= self._min_match:
            owner = self._owner(state, depth_of, bound, shared_hot, hot)
            if owner is not None:
                return Decision(owner, Route.PREFIX, depth_of[owner], bound)
            holders = [
                name
                for name, depth in depth_of.items()
                if depth >= self._min_match
                and within_bound(loads.get(name, 0), bound)
                and not hot(name)
            ]
            if holders:
                chosen = self._spread(state, holders, depth_of)
                return Decision(chosen, Route.PREFIX, depth_of[chosen], bound)
            shallower = [
                name
                for name in depth_of
                if within_bound(loads.get(name, 0), bound) and not hot(name)
            ]
            if shallower:
                chosen = self._spread(state, shallower, depth_of)
                return Decision(chosen, Route.OVERFLOW, depth_of[chosen], bound)
            picked = _ring_pick(
                ring, _key_after(state, deepest), state, bound, hot, 2, by_load=True
            )
            if picked is not None:
                return Decision(picked[0], Route.OVERFLOW, depth_of.get(picked[0], 0), bound)
        else:
            # A new prefix goes to its ring position, or the next one when that is busier.
            choices = 1 if state.keyed else self._hash_choices
            picked = _ring_pick(ring, state.affinity_key, state, bound, hot, choices)
            if picked is not None:
                name, passed_over = picked
                route = Route.OVERFLOW if passed_over else Route.HASH
                return Decision(name, route, depth_of.get(name, 0), bound)

        least = min(candidates, key=lambda name: loads.get(name, 0))
        return Decision(least, Route.FALLBACK, depth_of.get(least, 0), bound)

    def _owner(
        self,
        state: RoutingState,
        depth_of: dict[str, int],
        bound: int,
        shared_hot: bool,
        hot: _HotCheck,
    ) -> str | None:
        """The one backend holding clearly more of the prompt than any other, where moving
        the request would recompute that part for nothing."""
        owner = max(depth_of, key=lambda name: depth_of[name])
        depth = depth_of[owner]
        if depth <= state.private_from and (shared_hot or hot.busy(owner)):
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

    def _hot_check(self, state: RoutingState, total_load: int, count: int) -> _HotCheck:
        """Whether a backend's recent request count runs well above the mean, under load only.

        At low load affinity is free, and capping it there breaks long conversations.
        """
        if total_load < count or not state.recent:
            return _never_hot
        recent_total = state.recent_total
        if recent_total is None:
            recent_total = sum(state.recent.get(name, 0.0) for name in state.candidates)
        mean = recent_total / count
        slack = self._recent_slack
        return _HotCheck(
            state.recent,
            max(self._recent_cap * mean, mean + slack),
            max(self._factor * mean, mean + slack),
        )

    def _spread(self, state: RoutingState, names: Sequence[str], depth_of: dict[str, int]) -> str:
        """The deepest of `names`; ties to the least loaded, least recent, then a hash."""
        deepest = max(depth_of[name] for name in names)
        tied = [name for name in names if depth_of[name] == deepest]
        if len(tied) == 1:
            return tied[0]
        key = _key_after(state, deepest)
        loads = state.loads
        recent = state.recent
        return min(
            tied,
            key=lambda name: (
                loads.get(name, 0),
                round(recent.get(name, 0.0)),
                _rendezvous(key, name),
            ),
        )


class _HotCheck:
    """`hot(name)`: over the recent cap; `hot.busy(name)`: over the looser cap that an owner of
    a cold shared prompt may reach (the load factor times the mean) before it shares it."""

    __slots__ = ("_busy_cap", "_cap", "_recent")

    def __init__(self, recent: Mapping[str, float], cap: float, busy_cap: float) -> None:
        self._recent = recent
        self._cap = cap
        self._busy_cap = busy_cap

    def __call__(self, name: str) -> bool:
        return self._recent.get(name, 0.0) > self._cap

    def busy(self, name: str) -> bool:
        return self._recent.get(name, 0.0) > self._busy_cap


_never_hot = _HotCheck({}, math.inf, math.inf)


def _ring_pick(
    ring: HashRing,
    key: int,
    state: RoutingState,
    bound: int,
    hot: _HotCheck,
    choices: int,
    by_load: bool = False,
) -> tuple[str, bool] | None:
    """Of the first `choices` backends within `bound` and not hot on the ring from `key`, the
    one with the least pending prefill, then the fewest recent requests (`by_load`: the least
    loaded, then the least pending prefill, then the fewest recent requests); the first within
    `bound` if all are hot. With whether the walk passed over a backend before it (over the
    bound or hot)."""
    loads = state.loads
    fits: list[tuple[str, int]] = []
    first_fit: tuple[str, bool] | None = None
    for position, name in enumerate(ring.walk(key)):
        if not within_bound(loads.get(name, 0), bound):
            continue
        if hot(name):
            first_fit = first_fit or (name, True)
            continue
        fits.append((name, position))
        if len(fits) >= choices:
            break
    if not fits:
        return first_fit
    pending = state.pending_prefill
    recent = state.recent
    if by_load:
        name, position = min(
            fits,
            key=lambda fit: (
                loads.get(fit[0], 0),
                pending.get(fit[0], 0),
                round(recent.get(fit[0], 0.0)),
                fit[1],
            ),
        )
    else:
        name, position = min(
            fits, key=lambda fit: (pending.get(fit[0], 0), recent.get(fit[0], 0.0), fit[1])
        )
    # Positions run 0, 1, ... until a backend is passed over.
    passed_over = position != fits.index((name, position))
    return name, passed_over


def _rendezvous(key: int, name: str) -> int:
    """A per-key order of backends that every gateway computes alike."""
    return xxhash.xxh3_64_intdigest(name, seed=key & 0xFFFF_FFFF_FFFF_FFFF)


def _key_after(state: RoutingState, depth: int) -> int:
    """The hash of the first block past `depth`: it tells apart requests sharing that prefix."""
    if depth < len(state.hashes):
        return state.hashes[depth]
    return state.affinity_key
