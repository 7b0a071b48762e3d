"""The `prefix` policy: send a request where its prefix is cached, without hot spots.

`choose` reads a `RoutingState` and nothing else, and changes nothing but a cache of rings.
Over the n candidates (healthy backends serving the model), with c the load factor:

- The load bound is `B = max(floor, ceil(c · (total load + 1) / n))`.
- A backend is *eligible* under an allowance, a load bound and a cap on recent requests, when
  its load + 1 is within the bound and its recent request count (decaying, see
  `prefix_gateway.routing.traffic`) within the cap. The plain allowance is B with the *hot* cap
  `max(recent_cap · mean, mean + recent_slack)`, at any load: below one request in flight per
  backend the bound admits every backend, and the recent counts alone keep a popular prompt
  from filling one cache while the others idle. The slack keeps a burst's first few requests
  from counting as a trend.
- Where a rule picks among several backends, it takes the first in one order: the least
  pending prefill (prompt blocks sent there whose first byte has not come back), then the
  least load counted from the floor (loads the floor admits anyway compare equal), then the
  fewest recent requests (in whole requests), then the ring's clockwise order from the rule's
  key, which every gateway computes alike and which spreads ties instead of piling them on
  "the first".

The rules, the first that applies; each is the route label of its decision:

1. session — the backend bound to the request's session key, if it is a candidate within B.
2. owner — the deepest holder, when its match is at least the minimum and exceeds every other
   backend's by `owner_margin_blocks`, keeps the request up to a looser allowance: the bound
   stretched by the share s of the prompt only it holds, `ceil(B · (1 + s · (2c − 1)))`
   (moving the request would recompute that share for nothing). Past the first user message
   of a request that carries earlier answers, the part it alone holds is the request's own
   history: no recent cap. Otherwise it is a shared prompt (a match reaching into a first
   message's opening words is another request's): the owner keeps it only while the prompt
   is cold (at most c / n of the recent requests carried it, a customer's own system prompt
   say) and under the busy cap `max(c · mean, mean + recent_slack)`; a hot shared prompt
   spreads by the next rules.
3. prefix — the deepest eligible holder of a match of at least `min_match_blocks`, ties in the
   order above from the first block past the tied depth (a per-conversation key). Holders
   tied on a cold shared prompt (no deeper than it) go by the ring alone, clockwise from the
   prompt's own last block: every request carrying it, at any gateway, takes the same copy
   while that copy may take it, and the others age out of their caches instead of being kept
   warm by alternate requests.
4. overflow — holders of such a match exist but none is eligible: of the first `ring_choices`
   eligible backends clockwise from the first block past the match, the first in the order.
   It becomes a holder, so a popular prefix spreads to as many backends as its traffic needs.
5. hash — no match worth routing on: the same pick from the affinity key (the session key, or
   the prompt's first tokens from its first user message on), or, for a cold shared prompt,
   from the prompt's own last block: every gateway that has not heard of it yet (a write or a
   claim still on its way, Redis past its timeout) then meets the same two ring choices as
   the gateway that placed it, where a key from the question would start each request
   somewhere else. A request with a session key
   takes the first eligible backend in rules 4 and 5, so that its first requests, sent at
   once or through several gateways, agree before its binding is stored.
   adapter — the same where the model is a LoRA adapter, from the adapter's own key and
   without the recent cap: its requests gather on the first replica within B clockwise from
   the adapter and spill to the next only when B says so, so that replicas do not swap
   adapters in and out of their few resident slots. The overflow of an adapter's request
   walks from that key too, and its holders are eligible without the recent cap.
6. fallback — no candidate is eligible (those within B all run hot): the first within B
   clockwise from the rule's key. B always admits the least loaded candidate, who takes the
   request if the loads given were inconsistent.

Where each replica's time to first token is learned (`state.first_token`), a replica that
is clearly slower than the typical replica (`ttft_margin` times its predicted time or more for
the fleet's mean work, against the lower median of the replicas' times) has its recent
requests and its pending prefill counted as many times over as it is slower, before the
rules above: it has had its share with fewer requests, and its queue takes longer. On an even
fleet nothing changes. Then the rule's choice is weighed in seconds: the predicted time to
first token there, for the prompt tokens it must compute (the prompt less its match) and the
work ahead of it (its pending prefill), against the same prediction at every holder of the
prompt and at the first `_ALTERNATIVES` backends within B clockwise from the rule's key.
faster — one of them predicted to answer `ttft_margin` times sooner, sooner by more than the
fleet line's intercept (what any request costs: less is jitter) and by more than the standard
error of either replica's line, takes the request instead (the soonest). A hit is worth the
prefill it saves, in the same seconds; B still holds; a LoRA adapter's request is left where
its rule put it (loading an adapter is not in the model).

Cost: O(m log v) over the m backends the index matched, plus O(log(n · v)) for a ring walk (v
points per backend), when the caller passes the candidates' set, summed load and summed recent
counts (the router does); the index match that produced `matched` is linear in the prompt.
With the time to first token learned, O(m + a) predictions of O(1) each for the a alternatives,
plus O(k) for the k replicas counted as slow.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from prefix_gateway.config import Settings
from prefix_gateway.routing.ring import HashRing, RingCache, load_bound, within_bound
from prefix_gateway.routing.types import Decision, FirstTokenTimes, Route, RoutingState

_Order = Callable[[str], tuple[int, int, int, int]]

_NOISES = 1.0
"""How many standard errors of the replicas' lines a faster choice must gain."""

_ALTERNATIVES = 4
"""Backends within the bound, clockwise from the rule's key, weighed against its choice in
predicted seconds besides the prompt's holders: enough to find a fast replica with room among
a few slow ones, few enough that a decision stays O(log n)."""


@dataclass(frozen=True, slots=True)
class Allowance:
    """What an eligible backend stays within: a load bound and a cap on recent requests."""

    load_bound: int
    recent_cap: float = math.inf


def eligible(state: RoutingState, name: str, allowance: Allowance) -> bool:
    """Whether `name` may take this request under `allowance`."""
    return (
        within_bound(state.loads.get(name, 0), allowance.load_bound)
        and state.recent.get(name, 0.0) <= allowance.recent_cap
    )


class PrefixPolicy:
    def __init__(self, settings: Settings) -> None:
        self._factor = settings.load_factor
        self._floor = settings.load_floor
        self._min_match = settings.min_match_blocks
        self._margin = settings.owner_margin_blocks
        self._recent_cap = settings.recent_cap
        self._slack = settings.recent_slack
        self._choices = settings.ring_choices
        self._block_tokens = settings.block_tokens
        self._ttft_margin = settings.ttft_margin
        self._rings = RingCache()

    def choose(self, state: RoutingState) -> Decision:
        times = state.first_token
        if times is None:
            return self._by_rule(state)
        slowness = times.slowness()
        decision = self._by_rule(_weighed(state, slowness) if slowness else state)
        if decision.route is Route.ADAPTER:
            return decision
        return self._sooner(state, decision, times)

    def _by_rule(self, state: RoutingState) -> Decision:
        candidates = state.candidates
        members = state.members if state.members is not None else frozenset(candidates)
        count = len(candidates)
        total_load = state.summed_load()
        bound = load_bound(total_load, count, self._factor, self._floor)
        hot_cap, busy_cap = self._recent_caps(state, count)

        sticky = state.sticky
        if sticky is not None and sticky in members and eligible(state, sticky, Allowance(bound)):
            return Decision(sticky, Route.SESSION, state.matched.get(sticky, 0), bound)

        depth_of = {
            name: depth for name, depth in state.matched.items() if depth > 0 and name in members
        }
        ring = self._rings.get(members)
        adapter_key = state.adapter_key
        plain = Allowance(bound, hot_cap) if adapter_key is None else Allowance(bound)
        choices = 1 if state.keyed or adapter_key is not None else self._choices
        deepest = max(depth_of.values(), default=0)
        if deepest >= self._min_match:
            owner = self._owner(state, depth_of, bound, busy_cap)
            if owner is not None:
                return Decision(owner, Route.OWNER, depth_of[owner], bound)
            holders = [
                name
                for name, depth in depth_of.items()
                if depth >= self._min_match and eligible(state, name, plain)
            ]
            if holders:
                depth = max(depth_of[name] for name in holders)
                tied = [name for name in holders if depth_of[name] == depth]
                home = self._home(state, count)
                if home is not None and depth <= state.private_from:
                    chosen = min(tied, key=partial(ring.distance, home))
                else:
                    chosen = min(tied, key=self._order(state, ring, _key_after(state, depth)))
                return Decision(chosen, Route.PREFIX, depth, bound)
            key = _key_after(state, deepest) if adapter_key is None else adapter_key
            picked = self._ring_pick(state, ring, key, plain, choices)
            if picked is not None:
                return Decision(picked, Route.OVERFLOW, depth_of.get(picked, 0), bound)
        else:
            key = state.affinity_key if adapter_key is None else adapter_key
            home = self._home(state, count)
            if home is not None:
                key = home
            picked = self._ring_pick(state, ring, key, plain, choices)
            if picked is not None:
                route = Route.HASH if adapter_key is None else Route.ADAPTER
                return Decision(picked, route, depth_of.get(picked, 0), bound)

        chosen = self._ring_pick(state, ring, key, Allowance(bound), 1) or min(
            candidates, key=lambda name: state.loads.get(name, 0)
        )
        return Decision(chosen, Route.FALLBACK, depth_of.get(chosen, 0), bound)

    def _sooner(self, state: RoutingState, decision: Decision, times: FirstTokenTimes) -> Decision:
        """`decision`, with its predicted time to first token, or the faster choice."""
        block = self._block_tokens
        pending = state.pending_prefill
        matched = state.matched
        prompt = state.prompt_tokens

        def work(name: str) -> int:
            return pending.get(name, 0) * block + max(0, prompt - matched.get(name, 0) * block)

        chosen = decision.backend
        decision.ahead_tokens = pending.get(chosen, 0) * block
        predicted = times.seconds(chosen, work(chosen))
        decision.predicted_seconds = predicted
        if predicted is None:
            return decision
        members = state.members if state.members is not None else frozenset(state.candidates)
        bound, loads = decision.load_bound, state.loads
        options = [name for name, depth in matched.items() if depth > 0 and name in members]
        ring = self._rings.get(members)
        within = 0
        for name in ring.walk(_key_after(state, decision.matched_blocks)):
            if within_bound(loads.get(name, 0), bound):
                options.append(name)
                within += 1
                if within >= _ALTERNATIVES:
                    break
        # Sooner by the margin, and by more than a request's fixed cost.
        faster, soonest = chosen, min(predicted / self._ttft_margin, predicted - times.least_gain())
        noise = times.spread(chosen)
        for name in options:
            if name == chosen or not within_bound(loads.get(name, 0), bound):
                continue
            seconds = times.seconds(name, work(name))
            if (
                seconds is not None
                and seconds < soonest
                # Sooner by more than either prediction's noise: not a coin's toss.
                and predicted - seconds > _NOISES * max(noise, times.spread(name))
            ):
                faster, soonest = name, seconds
        if faster == chosen:
            return decision
        ahead = pending.get(faster, 0) * block
        return Decision(faster, Route.FASTER, matched.get(faster, 0), bound, ahead, soonest)

    def _home(self, state: RoutingState, count: int) -> int | None:
        """The ring key of a new cold shared prompt (a customer's own system prompt, at most
        c / n of recent requests): its last block. Placed from there, every request carrying
        it, at any gateway and whatever the index or a claim has told that gateway yet, meets
        the same two ring choices; placed from its own words, each would start elsewhere."""
        if state.keyed or state.adapter_key is not None:
            return None
        if not 0.0 < state.shared_share <= self._factor / count:
            return None
        shared_end = min(state.private_from, len(state.hashes))
        return state.hashes[shared_end - 1] if shared_end >= self._min_match else None

    def _recent_caps(self, state: RoutingState, count: int) -> tuple[float, float]:
        """The hot cap and the owner's busy cap on a backend's recent requests."""
        if not state.recent:
            return math.inf, math.inf
        recent_total = state.recent_total
        if recent_total is None:
            recent_total = sum(state.recent.get(name, 0.0) for name in state.candidates)
        mean = recent_total / count
        slack = self._slack
        return max(self._recent_cap * mean, mean + slack), max(self._factor * mean, mean + slack)

    def _owner(
        self, state: RoutingState, depth_of: dict[str, int], bound: int, busy_cap: float
    ) -> str | None:
        """The one backend holding clearly more of the prompt than any other, where moving
        the request would recompute that part for nothing."""
        owner = max(depth_of, key=lambda name: depth_of[name])
        depth = depth_of[owner]
        runner_up = max((other for name, other in depth_of.items() if name != owner), default=0)
        exclusive = depth - runner_up
        if exclusive < self._margin:
            return None
        recent_cap = math.inf
        if depth <= state.private_from or state.first_turn:
            if state.shared_share > self._factor / len(state.candidates):
                return None
            recent_cap = busy_cap
        share = exclusive / max(len(state.hashes), depth, 1)
        stretched = math.ceil(bound * (1.0 + share * (self._factor * 2 - 1)))
        if eligible(state, owner, Allowance(max(bound, stretched), recent_cap)):
            return owner
        return None

    def _ring_pick(
        self, state: RoutingState, ring: HashRing, key: int, allowance: Allowance, choices: int
    ) -> str | None:
        """Of the first `choices` backends eligible under `allowance` clockwise from `key`,
        the first in the policy's order."""
        fits: list[str] = []
        for name in ring.walk(key):
            if eligible(state, name, allowance):
                fits.append(name)
                if len(fits) >= choices:
                    break
        if len(fits) <= 1:
            return fits[0] if fits else None
        return min(fits, key=self._order(state, ring, key))

    def _order(self, state: RoutingState, ring: HashRing, key: int) -> _Order:
        """The one order of backends: least pending prefill, least load counted from the
        floor, fewest recent requests, then clockwise from `key` on the ring."""
        pending: Mapping[str, int] = state.pending_prefill
        loads = state.loads
        recent = state.recent
        free = self._floor - 1

        def rank(name: str) -> tuple[int, int, int, int]:
            # Recent requests in whole requests: counts a fraction apart (decayed from moments
            # a few milliseconds apart, at two gateways) fall to the ring, alike everywhere.
            return (
                pending.get(name, 0),
                max(loads.get(name, 0), free),
                round(recent.get(name, 0.0)),
                ring.distance(key, name),
            )

        return rank


class _Times(Mapping[str, Any]):
    """`counts`, with the slow backends' counted `slowness` times over."""

    __slots__ = ("_counts", "_slowness")

    def __init__(self, counts: Mapping[str, Any], slowness: Mapping[str, float]) -> None:
        self._counts = counts
        self._slowness = slowness

    def __getitem__(self, name: str) -> Any:
        return self._scaled(name, self._counts[name])

    def get(self, name: str, default: Any = 0) -> Any:
        return self._scaled(name, self._counts.get(name, default))

    def _scaled(self, name: str, count: Any) -> Any:
        times = self._slowness.get(name)
        if times is None:
            return count
        return count * times if isinstance(count, float) else round(count * times)

    def __iter__(self) -> Iterator[str]:
        return iter(self._counts)

    def __len__(self) -> int:
        return len(self._counts)


def _weighed(state: RoutingState, slowness: Mapping[str, float]) -> RoutingState:
    """`state` as the rules see it on an uneven fleet: a backend `k` times slower than the
    fleet has had its share of recent requests with 1/k of them, and its pending prefill takes
    `k` times as long; so both are counted `k` times over."""
    recent = state.recent
    recent_total = state.recent_total
    if recent_total is not None:
        members = state.members if state.members is not None else frozenset(state.candidates)
        recent_total += sum(
            recent.get(name, 0.0) * (times - 1.0)
            for name, times in slowness.items()
            if name in members
        )
    return replace(
        state,
        recent=_Times(recent, slowness),
        recent_total=recent_total,
        pending_prefill=_Times(state.pending_prefill, slowness),
    )


def _key_after(state: RoutingState, depth: int) -> int:
    """The hash of the first block past `depth`: it tells apart requests sharing that prefix."""
    if depth < len(state.hashes):
        return state.hashes[depth]
    return state.affinity_key
