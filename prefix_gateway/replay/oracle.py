"""The oracle: among the replicas within the gateway's bound, the deepest hit in its actual
cache wins, then the least loaded, then the ring order. Greedy; a reference, not a ceiling
(docs/replay.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from prefix_gateway.emulator.prefix_cache import PrefixCache
from prefix_gateway.replay.traces import TraceRequest
from prefix_gateway.routing.policies import Decision, Route
from prefix_gateway.routing.ring import HashRing, load_bound, within_bound


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
