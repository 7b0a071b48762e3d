"""Consistent hashing with bounded loads.

Each backend owns `vnodes` points on a 64-bit ring. A key walks clockwise from its point and
takes the first backend whose load is within the bound; a backend joining or leaving moves only
the keys whose walk passes its points, about 1/n of them. Lookup is a binary search:
O(log(n·vnodes)) to start, then O(1) a step. The clockwise distance from a key to a backend's
nearest point orders any set of backends the way the walk meets them, in O(log vnodes) each.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from collections.abc import Collection, Iterable, Iterator

import xxhash

DEFAULT_VNODES = 160
_SPAN = 1 << 64


def load_bound(total_load: int, backends: int, factor: float, floor: int) -> int:
    """The most load one backend may carry once the request being placed is counted.

    `ceil(factor * (total_load + 1) / backends)`, but never below `floor`: with little in
    flight the plain bound is below 1 and would move requests away from their cache for no
    gain.
    """
    if backends <= 0:
        return floor
    return max(floor, math.ceil(factor * (total_load + 1) / backends))


def within_bound(load: int, bound: int) -> bool:
    """Whether a backend carrying `load` may take one more request."""
    return load + 1 <= bound


class HashRing:
    def __init__(self, names: Iterable[str], vnodes: int = DEFAULT_VNODES) -> None:
        self.names = tuple(sorted(set(names)))
        points: list[tuple[int, str]] = []
        self._points_of: dict[str, list[int]] = {}
        for name in self.names:
            own = sorted(xxhash.xxh3_64_intdigest(f"{name}#{replica}") for replica in range(vnodes))
            self._points_of[name] = own
            points.extend((point, name) for point in own)
        points.sort()
        self._points = [point for point, _ in points]
        self._owners = [owner for _, owner in points]

    def walk(self, key: int) -> Iterator[str]:
        """Every backend once, in clockwise order from `key`."""
        if not self._points:
            return
        seen: set[str] = set()
        count = len(self._points)
        start = bisect.bisect_left(self._points, key)
        for step in range(count):
            owner = self._owners[(start + step) % count]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == len(self.names):
                    return

    def owner(self, key: int) -> str | None:
        return next(self.walk(key), None)

    def distance(self, key: int, name: str) -> int:
        """How far clockwise from `key` the walk meets `name`: sorting by it gives the walk's
        order. A name not on the ring sorts last."""
        own = self._points_of.get(name)
        if not own:
            return _SPAN
        at = bisect.bisect_left(own, key)
        return ((own[at] if at < len(own) else own[0]) - key) % _SPAN


class RingCache:
    """A small cache of hash rings, one per set of candidates, so a ring is built once."""

    def __init__(self, size: int = 64) -> None:
        self._size = size
        self._rings: OrderedDict[frozenset[str], HashRing] = OrderedDict()

    def get(self, candidates: Collection[str]) -> HashRing:
        """The ring of `candidates`; O(1) when given the pool's own frozenset of them (its hash
        is cached), O(n) for any other collection."""
        key = candidates if isinstance(candidates, frozenset) else frozenset(candidates)
        ring = self._rings.get(key)
        if ring is None:
            ring = self._rings[key] = HashRing(key)
            if len(self._rings) > self._size:
                self._rings.popitem(last=False)
        else:
            self._rings.move_to_end(key)
        return ring
