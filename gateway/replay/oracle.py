"""The oracle: routing with perfect knowledge of every replica's cache, under the same bound.

For each request, given the loads (requests in flight) before it:

1. The bound is the gateway's: `B = load_bound(total load, replicas, c, floor)` with the
   gateway's defaults (c = 1.25, floor 2); the eligible replicas are those `within_bound`
   (load + 1 ≤ B). The least loaded replica is always eligible.
2. Each eligible replica's depth is the number of the prompt's blocks its cache would reuse if
   the request were admitted now: `PrefixCache.hit_blocks` on the replica's actual contents
   (published blocks, pinned or evictable), not on what was sent to it.
3. The deepest wins; equal depths go to the least loaded, then to the first in the ring walk
   from the request's affinity key (the same ring the policies use).

It is greedy: it maximises each request's own hit and looks no further (it does not keep a
prefix off a replica to save that replica's cache for later traffic, nor reason about
evictions its choice causes). Its route is `prefix` when the chosen replica reuses at least
one block, `hash` otherwise. It records nothing: the caches are the truth it reads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gateway.emulator.prefix_cache import PrefixCache
from gateway.replay.traces import TraceRequest
from gateway.routing.policies import Decision, Route
from gateway.routing.ring import HashRing, load_bound, within_bound


class OracleRouter:
    def __init__(
        self, caches: Mapping[str, PrefixCache], load_factor: float, load_floor: int
    ) -> None:
        self._caches = dict(caches)
        self._names: Sequence[str] = list(caches)
        self._ring = HashRing(self._names)
        self._factor = load_factor
        self._floor = load_floor

    async def route(self, request: TraceRequest, loads: Mapping[str, int]) -> Decision:
        names = self._names
        bound = load_bound(sum(loads.values()), len(names), self._factor, self._floor)
        eligible = [name for name in names if within_bound(loads.get(name, 0), bound)]
        if not eligible:
            least = min(names, key=lambda name: loads.get(name, 0))
            return Decision(least, Route.FALLBACK, 0, bound)
        depth_of = {
            name: self._caches[name].hit_blocks(request.hashes, request.prompt_tokens)
            for name in eligible
        }
        order = {
            name: position for position, name in enumerate(self._ring.walk(request.affinity_key))
        }
        chosen = min(eligible, key=lambda name: (-depth_of[name], loads.get(name, 0), order[name]))
        depth = depth_of[chosen]
        return Decision(chosen, Route.PREFIX if depth > 0 else Route.HASH, depth, bound)

    def prefilled(self, request: TraceRequest, decision: Decision) -> None:
        return None

    async def answered(self, request: TraceRequest, backend: str) -> None:
        return None
